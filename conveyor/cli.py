"""The one entry point, ``conveyor``: each subcommand lives with its component.

Subcommands are imported lazily, so ``conveyor gateway`` never imports torch.
Each target is a ``main(argv) -> int`` that parses its own flags into its
component's settings dataclass.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "conveyor.runtime.server.cli",
        "start one runtime replica (OpenAI-compatible HTTP API)",
    ),
    "generate": ("conveyor.runtime.generate_cli", "generate text offline on a model (no server)"),
    "gateway": ("conveyor.gateway.cli", "start the load- and cache-aware gateway"),
    "operator": ("conveyor.operator.cli", "run the LLMService operator"),
    "cluster": (
        "conveyor.cluster.cli",
        "the one-machine Kubernetes cluster: up | down | status | build",
    ),
    "up": ("conveyor.cluster.stack", "bring the whole stack up on one machine"),
    "down": ("conveyor.cluster.stack", "tear the whole stack down"),
    "bench": (
        "conveyor.bench.cli",
        "benchmarks: offline, peer, gateway, startup, ... (its --help)",
    ),
    "dashboard": ("conveyor.observability.cli", "dashboards: render"),
    "image": (
        "conveyor.cluster.image_cli",
        "the project's image without a container engine: build",
    ),
}


def _usage() -> str:
    lines = ["usage: conveyor COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `conveyor COMMAND --help` for a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from conveyor import __version__

        print(f"conveyor {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"conveyor: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(
            f"conveyor {name}: this command is not available ({exc}). "
            "Install the extra it needs, e.g. `pip install 'conveyor[dev]'`.",
            file=sys.stderr,
        )
        return 2
    entry = getattr(module, f"main_{name}", None) or module.main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
