"""Compilers and ninja: build a model's sources into a pybind11 .so, or compile-check them.

The build is incremental (ninja), cached by a key over kiec's version, the sources and
the flags, and keeps the generated .hip beside the .so. `check` compiles the device code
alone for a target without any GPU: nvcc -cubin for sm_90a, Debian's clang-19 for gfx942.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .errors import KiecError, writable_folder
from .locks import held
from .targets import Target


# read once, at import: sysconfig fills its table on first use, and fixtures build in threads, where
# Python 3.11's first uses can race and read EXT_SUFFIX as None
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


@dataclass
class Build:
    folder: Path
    module_path: Path
    module_name: str
    report: str          # the compiler's register / spill / shared-memory report


def source_key(files: dict, target: Target, extra: str = "") -> str:
    h = hashlib.sha256()
    h.update(f"kiec {__version__} {target.name} {target.compile_flags} {extra}".encode())
    for name in sorted(files):
        h.update(name.encode())
        h.update(files[name].encode())
    return h.hexdigest()[:16]


def _which(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise KiecError("toolchain", tool, f"{tool} on PATH", "install it, or build on a machine that has it")
    return path


def write_sources(folder: Path, files: dict) -> None:
    writable_folder("build folder", folder)
    for name, text in files.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:      # ninja rebuilds only what changed
            try:
                path.write_text(text)
            except OSError as err:
                raise KiecError("build folder", str(folder), "a folder kiec can write", err.strerror) from None


def ninja_file(target: Target, module_file: str, headers=("kiec_port.h", "kiec_api.h")) -> str:
    import pybind11
    includes = f"-I{pybind11.get_include()} -I{sysconfig.get_paths()['include']}"
    # the kernel and the link go through the target's compiler (build checks it is there); the module's
    # C++ through the host compiler on NVIDIA, hipcc on AMD
    pic = "-Xcompiler -fPIC" if target.vendor == "nvidia" else "-fPIC"
    kernel = f"{target.compiler} {' '.join(target.compile_flags)} {pic} -c $in -o $out"
    link = f"{target.compiler} -shared $in -o $out"
    cxx = f"{'c++' if target.vendor == 'nvidia' else target.compiler} -O2 -fPIC -std=c++17 {includes} -c $in -o $out"
    return f"""# kiec build for {target.name}
rule kernel
  command = {kernel} > $out.log 2>&1 || (cat $out.log; exit 1)
  description = compile the monokernel ($in)
rule cxx
  command = {cxx}
  description = compile the Python module ($in)
rule link
  command = {link}
  description = link $out
build kernel.o: kernel kernel.hip | {' '.join(headers)}
build module.o: cxx module.cpp | {' '.join(headers)}
build {module_file}: link kernel.o module.o
"""


def build(files: dict, target: Target, folder: Path, module_name: str, quiet: bool = False) -> Build:
    writable_folder("build folder", folder)
    _which(target.compiler)             # named now, not inside ninja's log
    module_file = module_name + EXT_SUFFIX
    # another process building this folder (the same sources) holds it until its ninja is done
    with held(folder / ".lock", None if quiet else f"waiting for another build of {folder}"):
        headers = sorted(name for name in files if name.endswith(".h"))
        # written only where changed, as the sources are: a dump copied from the folder meanwhile stays whole
        write_sources(folder, dict(files, **{"build.ninja": ninja_file(target, module_file, headers)}))
        ninja = shutil.which("ninja") or _ninja_from_package()
        cmd = [ninja, "-C", str(folder)]
        if not quiet:
            print(f"[kiec] building {folder / module_file}", file=sys.stderr)
        run = subprocess.run(cmd, capture_output=True, text=True)
        log = folder / "kernel.o.log"
        report = resource_report(log.read_text()) if log.exists() else ""
    if run.returncode:
        raise KiecError("build", str(folder), "a clean compile", f"ninja failed:\n{run.stdout[-6000:]}{run.stderr[-2000:]}")
    return Build(folder=folder, module_path=folder / module_file, module_name=module_name, report=report)


def _ninja_from_package() -> str:
    try:
        import ninja
        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        return _which("ninja")


def resource_report(log: str) -> str:
    """The lines of ptxas -v (or the AMD equivalent) that matter: registers, spills, shared memory."""
    keep = [line.strip() for line in log.splitlines()
            if re.search(r"registers|spill|stack frame|smem|Compiling entry|VGPRs|SGPRs|ScratchSize|Occupancy", line)]
    return "\n".join(keep)


def check(files: dict, target: Target, folder: Path) -> str:
    """Compiles the kernel's device code alone; returns the compiler's report, raises on an error."""
    write_sources(folder, files)
    compiler = _which(target.check_compiler)
    out = folder / ("kernel.cubin" if target.vendor == "nvidia" else "kernel.gfx.o")
    defines = [] if target.vendor == "nvidia" else ["-nogpuinc", "-DKIEC_DEVICE_CHECK"]
    cmd = [compiler, *target.check_flags, *defines, str(folder / "kernel.hip"), "-o", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise KiecError("compile check", target.name, "no compile errors", f"{' '.join(cmd)}\n{run.stderr[-6000:]}")
    return resource_report(run.stderr + run.stdout) or "ok"
