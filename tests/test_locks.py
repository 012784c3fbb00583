"""A kernel folder is built by one process at a time, with its compiler named first where it is missing, and
the test run's shared models are written once."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiec.errors import KiecError
from kiec.locks import held
from kiec.targets import get_target
from kiec.toolchain import build

import once

# stands in for ninja: notes when it starts and ends a build of the folder it is given (-C FOLDER)
FAKE_NINJA = """#!/bin/sh
echo start >> "$2/runs"
sleep 0.4
echo end >> "$2/runs"
"""


def test_two_builds_of_one_folder_take_turns(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ninja").write_text(FAKE_NINJA)
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 1\n")      # found on PATH; the stand-in ninja never calls it
    for tool in ("ninja", "nvcc"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    folder, files = tmp_path / "kernel", {"kernel.hip": "// stage 0\n", "kiec_port.h": "", "module.cpp": ""}
    target = get_target("cuda:sm_90")
    first = threading.Thread(target=build, args=(files, target, folder, "kiec_x"))
    first.start()
    while not (folder / "runs").exists():          # the first build is inside its ninja, holding the folder
        time.sleep(0.01)
    build(files, target, folder, "kiec_x")
    first.join()
    assert (folder / "runs").read_text().split() == ["start", "end", "start", "end"]
    assert capsys.readouterr().err.count(f"waiting for another build of {folder}") == 1


@pytest.mark.parametrize("target,compiler", [("cuda:sm_90", "nvcc"), ("hip:gfx942", "hipcc")])
def test_a_build_without_its_compiler_names_it_before_ninja_runs(tmp_path, monkeypatch, target, compiler):
    monkeypatch.setenv("PATH", str(tmp_path))               # no compiler, no ninja
    with pytest.raises(KiecError, match=f"toolchain: got '{compiler}'; expected {compiler} on PATH"):
        build({"kernel.hip": "", "kiec_port.h": "", "module.cpp": ""}, get_target(target), tmp_path / "kernel", "kiec_x")
    assert not (tmp_path / "kernel" / "build.ninja").exists()


def test_a_lock_file_that_cannot_be_made_is_named(tmp_path):
    with pytest.raises(KiecError, match="lock file") as err:
        with held(tmp_path / "missing" / ".lock"):
            pass
    assert str(tmp_path / "missing" / ".lock") in str(err.value)


def test_a_shared_model_is_written_once(tmp_path_factory):
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(once.random_model(tmp_path_factory, "tiny-llama", 5, "fp32")))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(folders)) == 1
    written = (folders[0] / "model.safetensors").stat().st_mtime_ns
    assert once.random_model(tmp_path_factory, "tiny-llama", 5, "fp32") == folders[0]
    assert (folders[0] / "model.safetensors").stat().st_mtime_ns == written
    assert once.random_model(tmp_path_factory, "tiny-llama", 6, "fp32") != folders[0]


def test_the_runs_shared_folder_goes_when_the_run_ends(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path}",
                          "tests/test_locks.py::test_a_shared_model_is_written_once"],
                         cwd=repo, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
    assert tmp_path.exists() and not (tmp_path / "once").exists()
