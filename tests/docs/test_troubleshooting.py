"""Every error and problem code in the code base is documented in docs/troubleshooting.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
SOURCES = [
    ROOT / "agent" / "kvbridge_agent",
    ROOT / "operator" / "kvbridge_operator",
    ROOT / "operator" / "kvbridge_router",
]
CODE_PATTERNS = [
    re.compile(r'\bcode\s*=\s*"([A-Z][A-Z0-9_]+)"'),  # code="X" arguments and class attributes
    re.compile(r'^([A-Z][A-Z0-9_]+)\s*=\s*"\1"\s*$', re.MULTILINE),  # NAME = "NAME" constants
    re.compile(r'"code":\s*"([A-Z][A-Z0-9_]+)"'),  # {"code": "X"} replies
    re.compile(r'_error\(\s*"([A-Z][A-Z0-9_]+)"'),  # HTTP error bodies
    re.compile(r'get\("code",\s*"([A-Z][A-Z0-9_]+)"\)'),  # defaults for codes from elsewhere
    re.compile(r'RouteError\(\s*\w+,\s*"([A-Z][A-Z0-9_]+)"'),  # the router's errors
    re.compile(r'\("([A-Z][A-Z0-9_]+)", 50[24]\)'),  # the router's decode errors
    re.compile(r'(?:_refuse|_RefusedError|error_body)\(\s*\d+,\s*"([A-Z][A-Z0-9_]+)"'),  # the router's HTTP server
]


def codes_in_source() -> set[str]:
    found: set[str] = set()
    for root in SOURCES:
        for path in root.rglob("*.py"):
            text = path.read_text()
            for pattern in CODE_PATTERNS:
                found.update(pattern.findall(text))
    return found


def test_codes_are_found() -> None:
    codes = codes_in_source()
    assert {"TP_NOT_DIVISIBLE", "LOCAL_LONGER_THAN_REMOTE", "INVALID_SPEC", "WRONG_KIND"} <= codes


def test_every_code_is_documented() -> None:
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (ROOT / "docs" / "troubleshooting.md").read_text()))
    missing = sorted(codes_in_source() - documented)
    assert missing == [], f"add these codes to docs/troubleshooting.md: {missing}"
