"""The optimizer's state mapping, which reports every change that invalidates a step plan (plan.py).

FusedAdamW keeps `opt.state` as a `ParamStates` (a defaultdict(dict) to every reader) of `ParamState`s (plain
dicts to every reader): creating, loading, replacing or removing a state tensor bumps the optimizer's `Version`,
so a plan that holds the old tensor's address is rebuilt before the next step and no step has to look.
"""

from __future__ import annotations

from typing import Any


class Version:
    """A counter shared by the optimizer and its state mapping: any change that invalidates a plan bumps it."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class ParamState(dict):
    """One parameter's optimizer state (a plain dict to every reader). Setting or removing an entry bumps the
    optimizer's version, so a plan that holds the old tensor's address is rebuilt before the next step."""

    __slots__ = ("_version",)

    def __init__(self, version: Version, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._version = version

    def _changed(self) -> None:
        self._version.bump()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def pop(self, *args):
        value = super().pop(*args)
        self._changed()
        return value

    def popitem(self):
        item = super().popitem()
        self._changed()
        return item

    def setdefault(self, key, default=None):
        value = super().setdefault(key, default)
        self._changed()
        return value

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # pickles (and deep-copies) as a plain dict: state_dict files stay loadable anywhere
        return (dict, (dict(self),))


class ParamStates(dict):
    """The optimizer's `state` mapping (param -> ParamState), a defaultdict(dict) to every reader. Replacing
    or removing a param's state bumps the version; creating one for a param that had none does not (no plan
    can hold a state that did not exist)."""

    __slots__ = ("_version",)

    def __init__(self, version: Version, states: Any = ()) -> None:
        super().__init__()
        self._version = version
        for param, state in dict(states).items():
            dict.__setitem__(self, param, self._wrap(state))

    def _wrap(self, state) -> ParamState:
        if type(state) is ParamState and state._version is self._version:
            return state
        return ParamState(self._version, state)

    def __missing__(self, param) -> ParamState:
        state = ParamState(self._version)
        dict.__setitem__(self, param, state)
        return state

    def __setitem__(self, param, state) -> None:
        replaced = param in self
        dict.__setitem__(self, param, self._wrap(state))
        if replaced:
            self._version.bump()

    def __delitem__(self, param) -> None:
        super().__delitem__(param)
        self._version.bump()

    def clear(self) -> None:
        super().clear()
        self._version.bump()

    def pop(self, *args):
        value = super().pop(*args)
        self._version.bump()
        return value

    def popitem(self):
        item = super().popitem()
        self._version.bump()
        return item

    def update(self, *args, **kwargs) -> None:
        for param, state in dict(*args, **kwargs).items():
            self[param] = state

    @property
    def default_factory(self):  # what code written for torch's defaultdict(dict) may look at
        return dict

    def __reduce__(self):  # pickles (and deep-copies) as plain dicts
        return (dict, ({param: dict(state) for param, state in self.items()},))
