"""JSON Schema `format` values kvcap enforces, each a regular expression (kvcap's subset,
kvcap/sampling/regex.py) of strings the format allows. Where the whole format is not a regular
language, or is looser than what the readers of such strings accept, the expression takes a
subset, so that the output validates everywhere: a date never 29 February nor in year 0000, a
time always with its offset, an e-mail address a dot-atom (RFC 5321) at a host name of at most
three labels, a URI always scheme://host[:port][/path][?query][#fragment], a host name of at
most four labels whose last starts with a letter (as URL parsers following WHATWG want)."""

from __future__ import annotations

from kvcap.sampling.number_range import int_range

_DAY = ("(?:(?:01|03|05|07|08|10|12)-(?:0[1-9]|[12][0-9]|3[01])|(?:04|06|09|11)-"
        "(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
# years 0001-9999: year 0 is RFC 3339 text, but no date to Python, pydantic or jsonschema
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_DATE = f"{_YEAR}-{_DAY}"
_HOUR = "(?:[01][0-9]|2[0-3])"
_TIME = f"{_HOUR}:[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{{1,6}})?(?:Z|[+-]{_HOUR}:[0-5][0-9])"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = "[0-9a-f]{1,4}"
# RFC 1123 labels of at most 62 characters, so that four of them and their dots stay within
# the 253 a host name may have
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,60}[A-Za-z0-9])?"
_TOP_LABEL = "[A-Za-z](?:[A-Za-z0-9-]{0,60}[A-Za-z0-9])?"
_HOSTNAME = f"(?:{_LABEL}\\.){{0,3}}{_TOP_LABEL}"
# RFC 5321's dot-atom local part (no leading, trailing or doubled dot) of at most 64
# characters: one run, or up to four dotted runs of at most 15 and 16
_ATOM = "[A-Za-z0-9_%+-]"
_LOCAL = f"(?:{_ATOM}{{1,64}}|(?:{_ATOM}{{1,15}}\\.){{1,3}}{_ATOM}{{1,16}})"
# RFC 3986: a path / query / fragment character, percent escapes always with two hex digits
_PCHAR = "(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"


def _ipv6() -> str:
    """Eight groups, or fewer with one "::" standing for the rest (RFC 4291 2.2)."""
    forms = [f"{_H16}(?::{_H16}){{7}}"]
    for before in range(8):
        for after in range(8 - before):
            left = f"(?:{_H16}:){{{before - 1}}}{_H16}" if before else ""
            right = f"{_H16}(?::{_H16}){{{after - 1}}}" if after else ""
            forms.append(f"{left}::{right}")
    return "|".join(f"(?:{f})" for f in forms)


FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    # at most two labels before the top one: 64 + 1 + 2 x 63 + 24 stays within the 254
    # characters an address may have
    "email": f"{_LOCAL}@(?:{_LABEL}\\.){{1,2}}[A-Za-z]{{2,24}}",
    "ipv4": f"{_OCTET}(?:\\.{_OCTET}){{3}}",
    "ipv6": _ipv6(),
    "hostname": _HOSTNAME,
    "uri": (f"[a-z][a-z0-9+.-]{{0,15}}://{_HOSTNAME}(?::(?:{int_range(0, 65535)}))?"
            f"(?:/{_PCHAR}*)*(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"),
}
