#!/usr/bin/env python3
"""Build a model's monokernel from the repository without installing kiec: `python build.py model.json [--dump DIR]`.
The same as `kiec compile`; see README.md."""
import sys

from kiec.cli import main

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
