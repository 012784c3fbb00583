"""The decode kernel's machine code for a preset shape: did a template change move an instruction?

    python -m kiec.sass MODEL --out FILE [--options "a=1,b=2"] [--max-seq-len N] [--against FILE]

Renders MODEL's kernel (a synthetic preset: llama-3.2-1b, qwen2.5-1.5b, tiny-llama, ...) on the
target's defaults (132 multiprocessors, the H200's copies in flight), compiles it for sm_90a as the
compile check does, disassembles it with cuobjdump and writes decode_kernel's instructions to FILE with
their addresses and encodings stripped. Run it in two trees (from the root of a `git worktree` of the
commit before, say: `python -m` imports the tree it runs in; into a tree older than this tool, copy this
file): the listings are equal byte for byte exactly where the change moved no instruction, which is how
a change that should not touch the default kernel is checked without a GPU (docs/HOWTO.md). It prints the instruction
count and ptxas's registers and spills; with --against, whether FILE equals that listing (exit status
1 where it does not, and the first line that differs).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import KiecError

KERNEL = "decode_kernel"
BENCH_POSITIONS = 8224      # Llama-1B's bench build: context 8,192 and 32 steps
# an instruction line of `cuobjdump -sass`: /*address*/ instruction ; /* encoding */ (addresses of any width)
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s*(.*?)\s*;")


def kernel_listing(sass: str, kernel: str = KERNEL) -> list:
    """The instructions of the function whose mangled name holds `kernel`, without addresses or
    encodings, in order."""
    for function in sass.split("Function : ")[1:]:
        name, _, body = function.partition("\n")
        if kernel in name:
            return [m.group(1) for m in map(INSTRUCTION.match, body.splitlines()) if m]
    raise KiecError("sass", kernel, "a function of that name in the cubin")


def first_difference(a: list, b: list) -> int | None:
    """The first line (1-based) where two listings differ, or None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i + 1
    return None if len(a) == len(b) else min(len(a), len(b)) + 1


def build_listing(model: str, options: str, max_seq_len: int | None, folder: Path) -> tuple:
    """(listing, ptxas's report for the kernel) of a preset's default-device build, for `max_seq_len`
    positions (None: 8,224, Llama-1B's bench build, or the preset's fewer)."""
    from .model import load_spec
    from .options import CompileOptions
    from .pipeline import render_sources
    from .synthetic import preset
    from .targets import get_target
    from .toolchain import _which, check
    cuobjdump = _which("cuobjdump")
    (folder / "model").mkdir(parents=True, exist_ok=True)
    config = preset(model)
    (folder / "model" / "config.json").write_text(json.dumps(config))
    if max_seq_len is None:
        max_seq_len = min(BENCH_POSITIONS, config.get("max_position_embeddings", BENCH_POSITIONS))
    spec = load_spec({"weights": str(folder / "model"), "max_seq_len": max_seq_len})
    target = get_target("cuda:sm_90")
    _, _, files, _ = render_sources(spec, options=CompileOptions.parse(options) if options else None)
    report = check(files, target, folder / "build")
    run = subprocess.run([cuobjdump, "-sass", str(folder / "build" / "kernel.cubin")], capture_output=True, text=True)
    if run.returncode:
        raise KiecError("cuobjdump", str(folder / "build" / "kernel.cubin"), "a disassembly", run.stderr[-2000:])
    # ptxas reports each entry function in turn: the kernel's part, or all of it
    kernel_report = next((part for part in report.split("Compiling entry function") if KERNEL in part), report)
    return kernel_listing(run.stdout), kernel_report.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kiec.sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a synthetic preset (kiec.synthetic.PRESETS)")
    ap.add_argument("--out", required=True, help="where the listing goes")
    ap.add_argument("--options", default="", help="compile options, as kiec compile --options takes them")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="positions the build is for (8,224, Llama-1B's bench build, or the preset's fewer)")
    ap.add_argument("--against", help="a listing to compare with")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiec-sass-") as tmp:
        listing, report = build_listing(args.model, args.options, args.max_seq_len, Path(tmp))
    Path(args.out).write_text("\n".join(listing) + "\n")
    print(f"{args.model} [{args.options or 'default'}]: {len(listing)} instructions in {KERNEL}; "
          f"{' '.join(line for line in report.splitlines() if 'registers' in line or 'spill' in line)}")
    if args.against is None:
        return 0
    other = Path(args.against).read_text().splitlines()
    line = first_difference(listing, other)
    if line is None:
        print(f"the same as {args.against}, instruction for instruction")
        return 0
    print(f"differs from {args.against} ({len(other)} instructions) from line {line}: "
          f"{listing[line - 1] if line <= len(listing) else '(end)'} | {other[line - 1] if line <= len(other) else '(end)'}")
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KiecError as err:
        print(f"kiec.sass: {err}", file=sys.stderr)
        sys.exit(2)
