"""The `expertcache` command: one entry point, one subcommand per job.

    expertcache sim [TRACE ...]   replay routing traces through cache policies (sim.cli)
    expertcache serve --model DIR  serve a checkpoint over OpenAI- and Anthropic-compatible HTTP APIs (moe.serve.cli)
"""

from __future__ import annotations

import argparse
import os
import sys

from expertcache import __version__
from moe.serve import cli as serve_cli
from sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="Serve MoE models whose routed experts do not fit in GPU memory, "
        "and choose the cache policy and slot count from routing traces.")
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader of stdout left (`expertcache sim | head`): stop quietly, as Unix tools do; stdout
        # goes to devnull so the interpreter's final flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a command cut off by its pipe


if __name__ == "__main__":
    sys.exit(main())
