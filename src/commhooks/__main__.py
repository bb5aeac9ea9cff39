"""The ``commhooks`` command: ``commhooks bench [flags]`` (also ``python -m commhooks``)."""

import sys

__all__ = ["main"]

USAGE = """usage: commhooks bench [flags]

commands:
  bench   train a small model on local ranks with each hook and compare step time, bytes on
          the wire, memory and held-out loss (`commhooks bench --help` for the flags)
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] != "bench":
        print(
            f"commhooks: unknown command {args[0]!r}; valid commands: bench\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    from commhooks.bench.cli import main as bench_main

    return bench_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
