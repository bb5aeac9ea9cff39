"""The ``commhooks`` command: ``commhooks bench [flags]`` (also ``python -m commhooks``)."""

import sys
import textwrap

__all__ = ["main"]

COMMANDS = {
    "bench": "train a small model on local ranks with each hook, measure step time, bytes, "
    "memory and held-out loss, and predict which hook pays on which network link; under "
    "torchrun, measure your own network, GPUs and model (--model) instead "
    "(`commhooks bench --help` for its flags)",
}


def _usage() -> str:
    lines = ["usage: commhooks [--version] [--help] COMMAND [flags]", "", "commands:"]
    for name, text in COMMANDS.items():
        lines += textwrap.wrap(text, 80, initial_indent=f"  {name:8}", subsequent_indent=" " * 10)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; return its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args and args[0] in ("-V", "--version"):
        import commhooks

        print(f"commhooks {commhooks.__version__}")
        return 0
    if not args or args[0] not in COMMANDS:
        given = f"unknown command {args[0]!r}" if args else "no command given"
        print(f"commhooks: {given}; valid commands: {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    from commhooks.bench.cli import main as bench_main

    return bench_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
