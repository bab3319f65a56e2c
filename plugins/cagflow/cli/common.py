"""What the command groups share: a parser that names the subcommand in its errors, and the snapshot store
and the engine they open from the configuration."""

from __future__ import annotations

import argparse

from ..config import Config


class StrictParser(argparse.ArgumentParser):
    """Refuses an option a (sub)command does not have with that command's name, rather than leaving it to the
    top-level parser (argparse's default): `cagflow bench load --precisions` says that `bench load` has no
    --precisions."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)} (see: {self.prog} --help)")
        return parsed, extras


def open_configured_store(config: Config, url: str | None, role: str):
    """``url`` (default: ``cache.state_store``); ``role``: ``writer`` for commands that change the store
    (precompute, activate), else ``reader``."""
    from ..store.backends import open_store

    return open_store(url or config.cache.state_store, config.cache.s3, role=role)


def load_engine(config: Config):
    """Imported here, not at the top: loading the model stack takes seconds the other commands never pay."""
    from ..engine.engine import Engine

    return Engine.from_config(config.model, config.rules.disabled)
