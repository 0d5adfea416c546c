"""The web app's session store (:class:`sandlot.server._ui_session.Sessions`), the real
one: what one API key can do to everyone else's sessions."""

from __future__ import annotations

from sandlot.server._store import Principal
from sandlot.server._ui_session import MAX_SESSIONS, MAX_SESSIONS_PER_KEY, Sessions


def test_one_key_signing_in_over_and_over_cannot_sign_other_users_out() -> None:
    sessions = Sessions()
    victim_id, _ = sessions.create("sl_victim_secret", Principal("victim", "victim"))
    attacker = Principal("attacker", "attacker")
    # More sign-ins than the whole store holds, all with one key.
    for _ in range(MAX_SESSIONS + 1):
        last_id, _ = sessions.create("sl_attacker_secret", attacker)
    victim = sessions.get(victim_id)
    assert victim is not None and victim.tenant == "victim"
    # The attacker's key holds only its own newest sessions.
    assert sessions.count("sl_attacker_secret") == MAX_SESSIONS_PER_KEY
    assert sessions.get(last_id) is not None
    assert sessions.count() == MAX_SESSIONS_PER_KEY + 1


def test_drop_key_and_drop_keep_the_per_key_index_right() -> None:
    sessions = Sessions()
    ids = [sessions.create("sl_a_s", Principal("a", "a"))[0] for _ in range(3)]
    other, _ = sessions.create("sl_b_s", Principal("b", "b"))
    sessions.drop(ids[0])
    assert sessions.get(ids[0]) is None and sessions.count("sl_a_s") == 2
    sessions.drop_key("sl_a_s")
    assert sessions.count("sl_a_s") == 0 and sessions.count() == 1
    assert sessions.get(other) is not None
