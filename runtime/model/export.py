"""A built-in model written where another engine (vLLM, SGLang) can read it.

The operator runs this in an LLMService's model container, from Conveyor's image, before the
engine starts: a Hugging Face directory is linked as it is; a GGUF (which only Conveyor's
engine reads) is dequantized into a Hugging Face directory, losslessly in float32 unless asked
otherwise. Either way ``dest`` appears whole or not at all, so the engine's container can wait
for ``dest/config.json``.

    python -m conveyor.runtime.model.export smollm2-135m-instruct /cache/builtin/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from conveyor.runtime.model.builtin import BUILTIN_MODELS

DTYPES = ("float32", "bfloat16", "float16")


def write_builtin(name: str, dest: Path, dtype: str = "float32") -> Path:
    """Put built-in model ``name`` at ``dest`` as a Hugging Face directory (a no-op once there)."""
    if (dest / "config.json").exists():
        return dest
    from conveyor.runtime.model.loader import open_model

    files = open_model(name)
    if files.gguf is None:  # already a Hugging Face directory: link it, atomically
        dest.parent.mkdir(parents=True, exist_ok=True)
        link = dest.with_name(f".{dest.name}.{os.getpid()}")
        os.symlink(files.path, link)
        os.replace(link, dest)
        return dest
    import torch

    return files.gguf.save_pretrained(dest, getattr(torch, dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.runtime.model.export",
        description="Write a built-in model as a Hugging Face directory (config.json, "
        "tokenizer, safetensors) for an engine that cannot read Conveyor's built-in files.",
    )
    parser.add_argument("name", choices=BUILTIN_MODELS, help="the built-in model")
    parser.add_argument("dest", type=Path, help="the directory to write (must not be a file)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="weights of a dequantized GGUF (default float32: the GGUF's values exactly)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.dest.exists() and not args.dest.is_dir():
        parser.error(f"{args.dest} exists and is not a directory")
    path = write_builtin(args.name, args.dest, args.dtype)
    print(f"built-in model {args.name} at {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
