"""Code a cell runs to fetch a URL from inside a sandbox, shared by the egress tests.

``FETCH`` defines ``fetch(url)``, which answers a dict instead of raising: the status
and body, the refusal (status and reason), or the error's repr (status None).
"""

FETCH = """
import json, urllib.request, urllib.error
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return {"status": response.status, "body": response.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "reason": exc.reason}
    except Exception as exc:
        return {"status": None, "error": repr(exc)}
"""
