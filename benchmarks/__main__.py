"""Run every benchmark in sequence, or the ones named: ``python -m benchmarks [NAME ...]``."""

from __future__ import annotations

import importlib
import sys
import time

from benchmarks import BENCHMARKS


def _resolve(arg: str) -> str:
    matches = [b for b in BENCHMARKS if b == arg] or [b for b in BENCHMARKS if arg in b]
    if len(matches) != 1:
        raise SystemExit(f"unknown benchmark {arg!r}; choose from: {', '.join(BENCHMARKS)}")
    return matches[0]


def main(argv: list[str]) -> None:
    names = [_resolve(a) for a in argv] or list(BENCHMARKS)
    total = time.perf_counter()
    for name in names:
        print(f"\n=== {name} " + "=" * (70 - len(name)), flush=True)
        start = time.perf_counter()
        importlib.import_module(f"benchmarks.{name}").main()
        print(f"--- {name}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"\nall benchmarks: {time.perf_counter() - total:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
