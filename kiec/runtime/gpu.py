"""The GPU backend: the compiled monokernel behind the Backend interface."""
from __future__ import annotations


def gpu_available() -> bool:
    import shutil, subprocess
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
