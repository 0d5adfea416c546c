"""sandlot.safetext.escape: printable, one line, capped, idempotent."""

from __future__ import annotations

import pytest

from sandlot.safetext import MIN_LIMIT, escape


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("pypi.org", "pypi.org"),
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x1b[2K\x1b[1A\x07\x00\x7f", "\\x1b[2K\\x1b[1A\\x07\\x00\\x7f"),
        ("\x85\xa0", "\\x85\\xa0"),  # C1 control, no-break space
        ("evil\u202egnp.exe\u2028\u2029", "evil\\u202egnp.exe\\u2028\\u2029"),
        ("\U000e0041", "\\U000e0041"),  # a tag character (invisible)
        ("back\\slash", "back\\slash"),  # not doubled: the form is for reading
        ("ünïcödé 名前", "ünïcödé 名前"),
    ],
)
def test_escapes_what_is_not_printable(raw: str, shown: str) -> None:
    assert escape(raw) == shown
    assert escape(shown) == shown


def test_a_cap_cuts_with_a_marker_and_is_never_exceeded() -> None:
    text = escape("a" * 65536, 255)
    assert len(text) == 255 and text.endswith("...[cut 65301 chars]")
    for limit in (MIN_LIMIT, 100, 255, 1024):
        for raw in ("\x1b" * 5000, "a\n" * 5000, "\U000e0041" * 5000, "x" * (limit + 1)):
            cut = escape(raw, limit)
            assert len(cut) <= limit and cut.isprintable()
            assert escape(cut, limit) == cut  # idempotent, so every layer can apply it
    # Escapes are never cut in half.
    assert escape("\x1b" * 100, 40) == "\\x1b" * 5 + "...[cut 95 chars]"


def test_short_text_is_not_cut_and_other_values_are_text() -> None:
    assert escape("a" * 255, 255) == "a" * 255
    assert escape(ValueError("bad\nname")) == "bad\\nname"
    with pytest.raises(ValueError, match="at least"):
        escape("x", MIN_LIMIT - 1)
