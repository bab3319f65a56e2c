"""API keys from the command line: create, list, rotate, revoke, or issue the local ones; every change audited."""

from __future__ import annotations

import argparse
import sys

from ..config import Config


def _duration(text: str) -> float:
    from ..router.apikeys import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _change_keys(args: argparse.Namespace, config: Config, store) -> tuple[str | None, dict]:
    """Create, rotate, revoke or issue local keys; prints the outcome and returns the audit target and detail."""
    from ..router.apikeys import CREDENTIALS_FILE, ensure_local_keys

    if args.action == "create":
        record, plaintext = store.create(args.name, admin=args.admin, expires_in_s=args.expires)
        print(plaintext)
        print(f"created {'admin ' if record.admin else ''}key {record.key_id} ({record.name}) in {store.path}"
              f"{f', expires {record.expires}' if record.expires else ''}; the key is shown only now", file=sys.stderr)
        return record.key_id, {"name": record.name, "admin": record.admin, "expires": record.expires or None}
    if args.action == "rotate":
        old, new, plaintext = store.rotate(args.key, args.overlap, expires_in_s=args.expires)
        print(plaintext)
        print(f"rotated key {old.key_id} ({old.name}): the new key {new.key_id} works now "
              f"({f'expires {new.expires}' if new.expires else 'no expiry'}; shown only now), {old.key_id} until "
              f"{old.expires}. Move its clients to the new key, then `cagflow keys revoke {old.key_id}`",
              file=sys.stderr)
        return old.key_id, {"name": old.name, "new_key_id": new.key_id, "old_expires": old.expires,
                            "expires": new.expires or None}
    if args.action == "revoke":
        record = store.revoke(args.key)
        print(f"revoked key {record.key_id} ({record.name})")
        return record.key_id, {"name": record.name}
    credentials = ensure_local_keys(config)
    if credentials is None:
        print(f"local API keys already exist: {CREDENTIALS_FILE} (hashes in {store.path})")
        return None, {"issued": False}
    print(f"user key:  {credentials.api_key}\nadmin key: {credentials.admin_key}\n"
          f"saved for `cagflow ask` in {CREDENTIALS_FILE} (mode 0600); hashes in {store.path}")
    issued = [store.identify(plaintext) for plaintext in (credentials.api_key, credentials.admin_key)]
    return ", ".join(key.key_id for key in issued), {"issued": True}


def cmd_keys(args: argparse.Namespace, config: Config) -> int:
    """Key changes write an audit event (``service.audit_log_file``), failed ones too; listing does not."""
    from ..errors import CagflowError
    from ..router.apikeys import ApiKeyStore
    from ..router.audit import AuditLog, local_user

    store = ApiKeyStore(config.service.api_keys_file)
    if args.action == "list":
        keys = store.list()
        if not keys:
            print(f"no API keys in {store.path}; create one with `cagflow keys create --name NAME` "
                  "or `cagflow keys init-local`", file=sys.stderr)
        for key in keys:
            expiry = f"{'expired' if store.expired(key) else 'expires'} {key.expires}" if key.expires else "no expiry"
            print(f"{key.key_id}  {'admin' if key.admin else 'user ':<5}  {key.created:<20}  {expiry:<28}  {key.name}")
        return 0
    audit = AuditLog(config.service.audit_log_file)
    who = {"via": "cli", "user": local_user()}
    try:
        target, detail = _change_keys(args, config, store)
    except (CagflowError, ValueError, OSError) as exc:
        audit.record(f"keys.{args.action}", "error", target=getattr(args, "key", None), reason=str(exc), **who)
        raise
    audit.record(f"keys.{args.action}", "ok", target=target, detail=detail, **who)
    return 0


def add_keys(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="API keys: create, list, rotate, revoke, or issue local ones")
    key_actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = key_actions.add_parser("create", help="issue a key and print it (once)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.add_argument("--admin", action="store_true", help="may also call /admin endpoints")
    key_actions.add_parser("list", help="key ids, roles, creation and expiry times, names (never the keys)")
    rotate = key_actions.add_parser("rotate", help="issue a replacement (same name and role) and print it (once); "
                                                   "the old key keeps working for --overlap")
    rotate.add_argument("key", metavar="KEY", help="the key's id, or a name only one key has")
    rotate.add_argument("--overlap", type=_duration, default="24h", metavar="DURATION",
                        help="how long the old key keeps working (default 24h; 0s: it stops now)")
    revoke = key_actions.add_parser("revoke", help="delete a key; requests with it fail at once")
    revoke.add_argument("key", metavar="KEY", help="the key's id, or a name only one key has")
    for issuing in (create, rotate):
        issuing.add_argument("--expires", type=_duration, metavar="DURATION",
                             help="the new key stops working after this long (90s, 15m, 24h, 30d; default: never)")
    key_actions.add_parser("init-local", help="issue a local user and admin key for `cagflow ask`, unless they exist")
    keys.set_defaults(run=cmd_keys)
