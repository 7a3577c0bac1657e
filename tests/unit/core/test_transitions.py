"""The typed transitions (``hive_apps/core/state/transitions.py``): one message per transition, one table."""

from __future__ import annotations

import inspect
import pickle

import pytest
from pydantic import ValidationError

from hive_apps.core.settings import HiveSettings
from hive_apps.core.state import transitions as t
from hive_apps.core.state.book import ModelBook


@pytest.mark.parametrize("kind", list(t.RULES), ids=lambda k: k.__name__)
def test_each_message_carries_exactly_its_book_methods_arguments(kind):
    """The registry calls ``ModelBook.<method>(**fields, now=..., **settings)``: the table and the
    messages cannot drift from the methods they run."""
    rule = t.RULES[kind]
    params = inspect.signature(getattr(ModelBook, rule.method)).parameters
    wanted = {n for n in params if n != "self"}
    given = set(kind.model_fields) - ({"model_id"} if rule.by_record else set())
    given |= ({"now"} if rule.takes_now else set()) | set(rule.settings)
    assert given == wanted
    required = {n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty}
    optional = {n for n, f in kind.model_fields.items() if not f.is_required()}
    assert not required & optional, "a field the method requires has a default"
    assert all(hasattr(HiveSettings(), v) for v in rule.settings.values())


def test_the_name_lists_derive_from_the_table():
    assert t.ASKED == {r.method for r in t.RULES.values()} and len(t.ASKED) == len(t.RULES) == 25
    assert t.ADAPTER == {"create_adapter", "delete_adapter"} and t.MODEL == t.ASKED - t.ADAPTER
    assert all(t.RULES[t.BY_NAME[n]].method == n for n in t.ASKED)
    assert t.NOW <= t.ASKED and t.NEEDS_SAMPLE <= t.ASKED
    # everything that books device or host memory waits for the first sample: doze (level 1) too
    assert t.NEEDS_SAMPLE == {"create", "heal", "doze", "placed", "scale_up"}
    assert "doze" not in t.NOW  # doze records no time


def test_messages_are_frozen_checked_and_pickle():
    msg = t.Note(model_id="m", version=3, message="hello")
    assert msg.name == "note" and msg.arguments() == {"model_id": "m", "version": 3, "message": "hello",
                                                       "next_heal_at": None}
    assert pickle.loads(pickle.dumps(msg)) == msg  # Ray pickles it to the registry
    with pytest.raises(ValidationError):
        msg.model_id = "x"
    with pytest.raises(ValidationError):
        t.Retire(model_id="m", version=1)  # no index
    assert t.rule_of(msg) is t.RULES[t.Note] and t.rule_of("note") is None
