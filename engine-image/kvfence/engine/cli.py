"""``kvfence-engine``: the reference engine's command line.

Usage::

    kvfence-engine --config /etc/kvfence/engine.yaml [--host H] [--port N]
    python -m kvfence.engine --config engine.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from kvfence.contract.engine_config import ConfigError, load_config, load_signing_keys
from kvfence.engine.server import EngineServer, serve


def build_parser() -> argparse.ArgumentParser:
    """The command line (``engine.extraArgs`` may add the flags of kvfence.api.policy.engine_args that
    this parser knows and that policy allows)."""
    parser = argparse.ArgumentParser(prog="kvfence-engine", description="kvfence reference engine (CPU)")
    parser.add_argument("--config", required=True, help="engine configuration file (YAML or JSON)")
    parser.add_argument("--host", help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port, 0 for any free port (overrides listen.port)")
    parser.add_argument("--num-blocks", type=int, help="KV blocks in the pool (overrides numBlocks)")
    parser.add_argument("--signing-key-dir", help="directory with the signing keys (overrides signingKeyDir)")
    parser.add_argument("--port-file", help="write the bound port to this file once listening")
    parser.add_argument("--log-level", default=os.environ.get("KVFENCE_LOG_LEVEL", "INFO"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config).with_overrides(
            host=args.host, port=args.port, num_blocks=args.num_blocks, signing_key_dir=args.signing_key_dir
        )
        if config.require_signature:
            load_signing_keys(config.signing_key_dir)
        # Building the server builds the model: it refuses a dtype/quantization it cannot run.
        server = EngineServer(config, config_path=args.config)
    except (ConfigError, ValueError) as e:
        print(f"kvfence-engine: {e}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(args.port_file)

    asyncio.run(serve(config, server=server, ready=ready))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
