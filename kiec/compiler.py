"""`kiec compile`: the pipeline to a built .so (or, without a GPU toolchain, a device-only check).

    kiec compile model.json [--dump DIR] [--check] [--target hip:gfx942] [--options k=v,...]

It prints where the artifacts are and the compiler's register / spill report. With --dump
every stage's IR, the generated sources, build.ninja and the .so are written to DIR.
"""
from __future__ import annotations

import sys
from pathlib import Path


def register_compile(sub) -> None:
    from .cli_args import add_model_args, positive_int
    p = sub.add_parser("compile", help="compile a model into one persistent kernel and its Python module")
    add_model_args(p)
    p.add_argument("--target", help="cuda:sm_90 (default) or hip:gfx942")
    p.add_argument("--dump", type=Path, help="write every stage's IR, the sources and the build here")
    p.add_argument("--check", action="store_true",
                   help="compile the device code only (nvcc -cubin / clang-19 for gfx942): no GPU, no .so")
    p.add_argument("--multiprocessors", type=positive_int, help="size the grid for this many multiprocessors")
    p.add_argument("--options", default="", help="schedule knobs, e.g. slot_bytes=32768,max_slots=8")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args) -> int:
    from .cli_args import spec_from_args
    from .options import CompileOptions
    from .errors import writable_folder
    spec = spec_from_args(args)
    options = CompileOptions.parse(args.options)
    if args.dump is not None:
        writable_folder("--dump", args.dump)
    if args.check:
        return _check(spec, args, options)
    from .runtime.gpu import CompiledModel, device_multiprocessors
    sms = args.multiprocessors or device_multiprocessors()
    # a grid sized by hand may be another device's: then its memory's pace is unknown here too
    model = CompiledModel(spec, sms, quiet=args.quiet, dump=args.dump, options=options,
                          device=None if args.multiprocessors else 0)
    grid = model.sched.grid
    print(f"kernel   {model.build.folder / 'kernel.hip'}")
    print(f"module   {model.build.module_path}")
    if args.dump:
        print(f"dump     {args.dump}")
    print(f"grid     {grid.blocks} blocks x {grid.threads} threads, {grid.slots} ring slots of {grid.slot_bytes} bytes "
          f"({grid.copies_summary}), {len(model.sched.stages)} stages; "
          f"built in {model.build_s:.1f} s")
    print(model.build.report)
    return 0


def _check(spec, args, options) -> int:
    from .pipeline import render_sources
    from .targets import get_target
    from .toolchain import check
    _, sched, files, name = render_sources(spec, args.multiprocessors, args.dump, options)
    folder = args.dump or Path.cwd() / "build" / name
    report = check(files, get_target(spec.target), folder)
    print(f"checked  {spec.target}: {folder / 'kernel.hip'} compiles ({len(sched.stages)} stages)", file=sys.stdout)
    print(report)
    return 0
