"""Code that runs inside a sandbox and attacks the egress records (floods, forged names).

Shared by the local (``test_flood.py``) and server (``test_server_audit.py``) tests.
Everything goes to the forwarder at 127.0.0.1:3128, the sandbox's only way out.
"""

from __future__ import annotations

FLOOD_SECONDS = 4.0
"""How long a flood lasts (the sandbox's side)."""

HUGE_HOST = "a" * 60_000
"""Fits the proxy's 64 KiB request head, so the whole name reaches the decision."""

FORGED = (
    "evil.test\n2026-01-01T00:00:00Z\tbob\tsbx0000000000000000\tallowed\tCONNECT\t"
    "bank.test:443\tin=0\tout=0\tallow_out\tentry\t'bank.test'\x1b[2K\x1b[1A\x1b[31m"
)
"""A host name that, printed raw, ends one audit line and forges another (for another
tenant, allowed), then moves the cursor and colours the terminal. Tabs, not spaces:
a CONNECT request line is split at spaces."""

ASK = """
import json, socket, time

def ask(payload, socks=False):
    # One connection, one request; True when the proxy refused it (403 or SOCKS5 0x02).
    with socket.create_connection(("127.0.0.1", 3128), timeout=60) as s:
        s.sendall((b"\\x05\\x01\\x00" if socks else b"") + payload)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if socks:
        return data[:4] == b"\\x05\\x00\\x05\\x02"
    return data.startswith(b"HTTP/1.1 403 ")

def connect(host, port):
    return ask(f"CONNECT {host}:{port} HTTP/1.1\\r\\n\\r\\n".encode("latin-1"))

def socks5(host, port):
    name = host.encode("latin-1")
    return ask(
        b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"), socks=True
    )
"""

FLOOD = (
    ASK
    + f"""
huge = "a" * {len(HUGE_HOST)}
long_name = "b" * 255
counts = {{"connect": 0, "socks5": 0, "other": 0}}
started = time.monotonic()
while time.monotonic() - started < {FLOOD_SECONDS}:
    counts["connect" if connect(huge, 1) else "other"] += 1
    counts["socks5" if socks5(long_name, 1) else "other"] += 1
counts["seconds"] = time.monotonic() - started
print(json.dumps(counts))
"""
)
"""Refused CONNECTs to a 60,000-character name and SOCKS5 CONNECTs to a 255-character
one, alternately, for FLOOD_SECONDS; prints the counts of refusals the sandbox saw."""

INJECT = (
    ASK
    + f"""
forged = {FORGED!r}
print(json.dumps([connect(forged, 443), socks5(forged, 443)]))
"""
)
"""One CONNECT and one SOCKS5 CONNECT to the FORGED name; both refused."""
