"""One adapter from a framework's options to a :class:`~gspo_kernels.GSPOConfig`.

Each integration (TRL, verl, OpenRLHF, Megatron, the library's own trainers) *declares* how its framework's names
become ``GSPOConfig`` fields, as a :class:`Declaration`: :func:`rename` (a framework option read under its own name,
optionally converted), :func:`constant`, :func:`derived` (a value computed from the options object) and
:class:`Refusal` (an option value the library cannot honour, refused with an error naming the framework's option).
:func:`build_config` applies a declaration to the framework's options object and builds the config;
:func:`config_options` gives the keyword arguments it would pass.

An options object is read as the integrations always read theirs: ``options.get(key, default)`` where it has a
callable ``get`` (a mapping, an OmegaConf ``DictConfig``), else its attribute; a dotted option (``"args.delta"``)
follows attributes. This module imports only the config: the trainers of ``train/`` use it without a framework.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from gspo_kernels.config import GSPOConfig

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()  # no default: the option must exist

Condition = Optional[Callable[[Any], bool]]


@dataclass(frozen=True)
class Rule:
    """One ``GSPOConfig`` field from a framework's options: the value of ``option`` (through ``convert``), the
    constant ``value``, or ``derive(options)``; only where ``when(options)`` holds (None: always). Build rules with
    :func:`rename`, :func:`constant`, :func:`derived`."""

    field: str
    option: Optional[str] = None
    default: Any = MISSING
    convert: Optional[Callable[[Any], Any]] = None
    value: Any = MISSING
    derive: Optional[Callable[[Any], Any]] = None
    when: Condition = None

    def applies(self, options: Any) -> bool:
        return self.when is None or bool(self.when(options))

    def resolve(self, options: Any, framework: str) -> Any:
        """The field's value from ``options``."""
        if self.derive is not None:
            return self.derive(options)
        if self.option is None:
            return self.value
        value = read(options, self.option, self.default, framework)
        return value if self.convert is None else self.convert(value)


def rename(field: str, option: Optional[str] = None, *, default: Any = MISSING,
           convert: Optional[Callable[[Any], Any]] = None, when: Condition = None) -> Rule:
    """``field`` is the framework's ``option`` (default: the same name), read with ``default`` where the options lack
    it (no default: a ``ValueError`` naming the option), then ``convert``-ed."""
    return Rule(field, option=field if option is None else option, default=default, convert=convert, when=when)


def constant(field: str, value: Any, *, when: Condition = None) -> Rule:
    """``field`` is always ``value`` for this framework."""
    return Rule(field, value=value, when=when)


def derived(field: str, derive: Callable[[Any], Any], *, when: Condition = None) -> Rule:
    """``field`` is ``derive(options)`` (several of the framework's options, or a value it implies)."""
    return Rule(field, derive=derive, when=when)


@dataclass(frozen=True)
class Refusal:
    """A value of the framework's ``option`` the library cannot honour: refused where ``allowed(value)`` is false
    (and ``when(options)`` holds), with ``problem`` formatted with ``option`` and ``value`` (default: the option and
    the value, e.g. ``loss_type='x' is not supported``). The value is read as a rule reads it (``default`` where the
    options lack it), through ``convert``."""

    option: str
    allowed: Callable[[Any], bool]
    problem: str = "{option}={value!r} is not supported"
    default: Any = MISSING
    convert: Optional[Callable[[Any], Any]] = None
    when: Condition = None


def _field_names() -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(GSPOConfig))


@dataclass(frozen=True)
class Declaration:
    """How the framework ``framework`` (named in errors) maps onto ``GSPOConfig``: its ``rules`` (applied in order,
    a later rule of the same field overriding an earlier one) and its ``refusals`` (checked first, in order). A rule
    naming no ``GSPOConfig`` field is refused when the declaration is made."""

    framework: str
    rules: Tuple[Rule, ...] = ()
    refusals: Tuple[Refusal, ...] = ()

    def __post_init__(self) -> None:
        fields = _field_names()
        unknown = [rule.field for rule in self.rules if rule.field not in fields]
        if unknown:
            raise ValueError(f"{self.framework}'s declaration maps onto unknown GSPOConfig field(s) "
                             f"{', '.join(map(repr, unknown))}")

    def extend(self, *rules: Rule, refusals: Tuple[Refusal, ...] = ()) -> "Declaration":
        """This declaration with more rules (applied after its own) and refusals."""
        return Declaration(self.framework, self.rules + tuple(rules), self.refusals + tuple(refusals))


def read(options: Any, option: str, default: Any = MISSING, framework: str = "the framework") -> Any:
    """The framework's ``option`` from ``options`` (``get(key, default)`` or the attribute; dotted: attributes
    followed); ``default`` where it is missing, else a ``ValueError`` naming the option."""
    value = options
    for key in option.split("."):
        getter = getattr(value, "get", None)
        value = getter(key, MISSING) if callable(getter) else getattr(value, key, MISSING)
        if value is MISSING:
            if default is not MISSING:
                return default
            raise ValueError(f"{framework}'s options have no {option!r}")
    return value


def refused(declaration: Declaration, options: Any) -> List[str]:
    """The problems of ``options`` under ``declaration``'s refusals, one text each naming the option."""
    problems = []
    for refusal in declaration.refusals:
        if refusal.when is not None and not refusal.when(options):
            continue
        value = read(options, refusal.option, refusal.default, declaration.framework)
        if refusal.convert is not None:
            value = refusal.convert(value)
        if not refusal.allowed(value):
            problems.append(refusal.problem.format(option=refusal.option, value=value))
    return problems


def check(declaration: Declaration, options: Any) -> None:
    """Raise a ``ValueError`` with the first of :func:`refused`'s problems, if any."""
    problems = refused(declaration, options)
    if problems:
        raise ValueError(problems[0])


def config_options(declaration: Declaration, options: Any) -> Dict[str, Any]:
    """The ``GSPOConfig`` keyword arguments ``declaration`` gives for ``options`` (the refusals not checked)."""
    out: Dict[str, Any] = {}
    for rule in declaration.rules:
        if rule.applies(options):
            out[rule.field] = rule.resolve(options, declaration.framework)
    return out


def build_config(declaration: Declaration, options: Any) -> GSPOConfig:
    """The ``GSPOConfig`` of the framework's ``options``: :func:`check` (the refusals), then the rules' fields
    (every other field at its default; ``GSPOConfig`` validates them as usual)."""
    check(declaration, options)
    return GSPOConfig(**config_options(declaration, options))
