"""Numbers in the text users write: policies, layouts, option values and
the labels reports carry.  Python's int() and float() also read other
scripts' digits ('٤' is 4), '_' separators ('1_0') and surrounding
spaces, and str.isdigit() takes superscripts ('²'), which int() then
refuses with a traceback; a number here is ASCII alone, so that every
parser accepts the same text and refuses the rest in its own words."""
import re

_WHOLE = re.compile(r"[0-9]+")
_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|nan|inf|infinity)",
                     re.IGNORECASE)


def whole(text):
    """The whole number `text` writes in ASCII digits alone (no sign, no
    space), or None."""
    return int(text) if isinstance(text, str) and _WHOLE.fullmatch(text) else None


def integer(text):
    """The int `text` writes in ASCII digits after an optional sign, or None."""
    return int(text) if isinstance(text, str) and _INTEGER.fullmatch(text) else None


def number(text):
    """The float `text` writes in ASCII (digits, one '.', an exponent, a
    sign; nan and inf as float() reads them, for the callers' ranges to
    refuse), or None: no '_', no space, no other script's digits."""
    return float(text) if isinstance(text, str) and _NUMBER.fullmatch(text) else None
