"""No secret in the repository: every file git would commit (tracked, or new and not ignored) is scanned for
private keys, this project's API keys, AWS access keys and secret keys, and, in configuration, compose, env
and shell files, for passwords and other secrets assigned a literal value. The files that hold the real
secrets of a deployment stay ignored. Each exception is listed in ``ALLOWED_VALUES`` with its reason."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from cagflow.router.apikeys import KEY_ID_BYTES, KEY_PREFIX, SECRET_BYTES

REPO = Path(__file__).resolve().parents[2]

EVERYWHERE = {
    "private key": re.compile(r"-----BEGIN[A-Z ]*PRIVATE KEY( BLOCK)?-----"),
    # The secret is SECRET_BYTES random bytes in URL-safe base64: longer than SECRET_BYTES characters.
    "CAGFlow API key": re.compile(rf"{KEY_PREFIX}_[0-9a-f]{{{2 * KEY_ID_BYTES}}}_[A-Za-z0-9_-]{{{SECRET_BYTES}}}"),
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b"),
    "AWS secret access key": re.compile(
        r"(?i)secret_?(?:access_?)?key[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"),
}
# Files that configure a deployment: a literal value assigned to a secret's name is a finding there.
CONFIG_SUFFIXES = {".yml", ".yaml", ".toml", ".ini", ".cfg", ".conf", ".env", ".json", ".properties", ".sh"}
CONFIG_NAMES = ("Dockerfile", "Makefile", ".env", "env.")
SECRET_NAME = re.compile(r"(?i)passw(?:or)?d|secret|(?<![a-z])token(?![a-z])|(?:api|access|private|fernet)_?key")
ASSIGNMENT = re.compile(r"(?m)^[ \t]*(?:export[ \t]+|-[ \t]+)?[\"']?(?P<name>[A-Za-z0-9_.-]+)[\"']?[ \t]*[:=][ \t]*"
                        r"(?P<value>.*)$")
URL_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:(?P<value>[^@\s/]+)@")
VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE]-?\d+)?,?")

# A literal secret-named value allowed in a configuration file, and why it is not a secret.
ALLOWED_VALUES = {
    "change-me": "docker/env.example's placeholder: the file says to replace every value in a docker/.env of one's own",
    "change-me-too": "the same placeholder for the S3 secret key, different so that the two are not left equal",
    "[airflow_passwords]": "docker-compose.yml: the name of the compose secret a service mounts, not its value",
}
# Where a deployment's real secrets live; git must keep ignoring them.
SECRET_FILES = ("docker/.env", "docker/airflow-passwords.json")


def _literal(raw: str) -> str:
    """The value of an assignment without quotes or a trailing comment."""
    raw = raw.strip()
    if raw[:1] in ("'", '"'):
        return raw[1:].split(raw[0], 1)[0]
    return re.split(r"\s+#", raw, maxsplit=1)[0].strip()


def _allowed(name: str, value: str) -> bool:
    return (not value  # to be filled in, or a YAML section
            or VARIABLE.fullmatch(value) is not None  # taken from the environment at run time
            or value.startswith("$(")  # generated at run time by a shell command (e.g. openssl rand)
            or name.lower().endswith("_file")  # the path of a secret file (Docker/Kubernetes secrets), not the secret
            or NUMBER.fullmatch(value) is not None  # a measurement named for tokens (bench results), not a key
            or value in ALLOWED_VALUES)


def _is_config(path: Path) -> bool:
    return path.suffix in CONFIG_SUFFIXES or path.name.startswith(CONFIG_NAMES)


def findings(text: str, path: Path) -> list[str]:
    found = [f"{kind}: {match.group(0)[:60]}" for kind, pattern in EVERYWHERE.items() for match in pattern.finditer(text)]
    if _is_config(path):
        found += [f"secret assigned: {match.group('name')}" for match in ASSIGNMENT.finditer(text)
                  if SECRET_NAME.search(match.group("name"))
                  and not _allowed(match.group("name"), _literal(match.group("value")))]
        found += [f"password in a URL: {match.group(0)[:60]}" for match in URL_PASSWORD.finditer(text)
                  if not VARIABLE.match(match.group("value"))]
    return found


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def committable() -> list[Path]:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing here would be committed")
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    assert listed.returncode == 0, listed.stderr
    return [REPO / name for name in listed.stdout.split("\0") if name and (REPO / name).is_file()]


def test_no_secret_in_any_file_git_would_commit(committable):
    report = {}
    for path in committable:
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        found = findings(data.decode("utf-8", "replace"), path)
        if found:
            report[str(path.relative_to(REPO))] = found
    assert report == {}, f"secrets in the repository (or add a placeholder to ALLOWED_VALUES, with its reason): {report}"


def test_the_files_holding_real_secrets_stay_ignored():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    checked = _git("check-ignore", "--no-index", *SECRET_FILES)
    assert sorted(checked.stdout.split()) == sorted(SECRET_FILES), checked.stdout + checked.stderr


# The samples are assembled at run time, so this file never holds what it looks for.
SAMPLES = [
    ("notes.md", "-----BEGIN " + "OPENSSH PRIVATE KEY-----\nb3Blbn...", "private key"),
    ("notes.md", "-----BEGIN " + "PRIVATE KEY-----", "private key"),
    ("app.py", f'KEY = "{KEY_PREFIX}_{"0a1b2c" * 2}_{"Zx9-_" * 9}"', "CAGFlow API key"),
    ("deploy.sh", "aws configure set aws_access_key_id " + "AKIA" + "Q" * 16, "AWS access key id"),
    ("settings.py", "aws_secret_access_key = '" + "wJalrXUtnFEMI/K7MDENG+bPxRfiCY" + "A" * 10 + "'", "AWS secret access key"),
    ("docker/.env.prod", "POSTGRES_PASSWORD=hunter2", "secret assigned: POSTGRES_PASSWORD"),
    ("compose.yml", "    AUTH_TOKEN: 'abc123'  # quoted", "secret assigned: AUTH_TOKEN"),
    ("config.yaml", "db: postgresql://airflow:" + "hunter2@postgres/airflow", "password in a URL"),
]
CLEAN = [
    ("env.example", "S3_SECRET_KEY=change-me-too\nAIRFLOW_FERNET_KEY=\n"),
    ("compose.yml", "  AWS_SECRET_ACCESS_KEY: ${S3_SECRET_KEY:?set it}\n  DB_PASSWORD: $DB_PASSWORD\n"),
    ("compose.yml", "  PASSWORDS_FILE: /run/secrets/airflow_passwords\n  secrets:\n"),
    ("config.yaml", "  max_new_tokens: 128\n  chunk_tokens: 200  # tokens\n"),
    ("config.yaml", "url: postgresql+psycopg2://airflow:${AIRFLOW_DB_PASSWORD}@postgres/airflow"),
    ("test_app.py", 'headers = {"Authorization": "Bearer ' + KEY_PREFIX + '_000000000000_wrong"}\npassword = "x"'),
    ("engine-20261206T211855Z.json", '      "snapshot_bytes_per_token": 28672.0,\n      "prompt_token": 12\n'),
]


@pytest.mark.parametrize("name, text, kind", SAMPLES, ids=[kind for _, _, kind in SAMPLES])
def test_each_kind_of_secret_is_found(name, text, kind):
    assert [finding for finding in findings(text, Path(name)) if finding.startswith(kind)]


@pytest.mark.parametrize("name, text", CLEAN, ids=[name for name, _ in CLEAN])
def test_placeholders_references_and_look_alikes_pass(name, text):
    assert findings(text, Path(name)) == []
