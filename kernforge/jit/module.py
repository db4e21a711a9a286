"""Kernel modules, declared once.

A :class:`Module` names a template, its compile-time parameters (typed, with
their allowed values), the ISA tiers it is built for and its entry points
(typed C arguments, optionally a declared argument struct). Everything else
derives from that one declaration:

* the C declarations the template emits (``{{ decl.run }}``, ``{{ abi_structs }}``)
  and the matching cffi ``cdef``;
* the call binding: :meth:`Kernel.bind` / :meth:`Kernel.call` check argument
  names against the declaration, and :meth:`Kernel.new` fills a declared struct
  by field name;
* the readable key prefix (``norm_dtype-bf16_fused_add-0_gemma-0_avx512``), safe
  as a file name for every value, tuples included;
* the manifest schema pre-warm validates against.

A wrong parameter value, a list where a tuple is meant, an unknown argument or
one left out fails here, with the module and the name in the message, never
silently in C++.
"""

from __future__ import annotations

import keyword
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# C types an entry argument, return value or struct field may have.
SCALAR_CTYPES = ("int64_t", "int32_t", "uint64_t", "uint32_t", "uint8_t", "double", "float")
_RETURN_CTYPES = ("void", "int64_t", "int32_t", "double")


class DeclarationError(ValueError):
    """A module declaration, parameter value or argument binding is wrong."""


# --------------------------------------------------------------------------- parameter types


class Param:
    """A compile-time parameter's type: checks a value and spells it for keys and templates."""

    kind = "param"

    def check(self, module: str, name: str, value: Any) -> Any:
        raise NotImplementedError

    def key_text(self, value: Any) -> str:
        return str(value)

    def schema(self) -> dict:
        return {"type": self.kind}

    def _reject(self, module: str, name: str, value: Any, expected: str) -> DeclarationError:
        return DeclarationError(f"{module}: parameter {name} must be {expected}, got {value!r}")


class Bool(Param):
    kind = "bool"

    def check(self, module, name, value):
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # manifests and the CLI spell them 0/1
            return bool(value)
        raise self._reject(module, name, value, "a bool")

    def key_text(self, value):
        return str(int(value))


@dataclass(frozen=True)
class Int(Param):
    """An integer, from ``choices`` if given, else within [minimum, maximum]."""

    choices: tuple[int, ...] | None = None
    minimum: int | None = None
    maximum: int | None = None
    kind = "int"

    def check(self, module, name, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._reject(module, name, value, "an int")
        if self.choices is not None and value not in self.choices:
            raise self._reject(module, name, value, f"one of {', '.join(map(str, self.choices))}")
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise self._reject(module, name, value, f"in [{self.minimum}, {self.maximum}]")
        return int(value)

    def schema(self):
        return {"type": "int", "choices": self.choices, "minimum": self.minimum, "maximum": self.maximum}


@dataclass(frozen=True)
class Enum(Param):
    """One of a few identifiers (an activation, a layout)."""

    choices: tuple[str, ...]
    kind = "enum"

    def __post_init__(self):
        bad = [c for c in self.choices if not _IDENTIFIER.match(c)]
        if bad:
            raise DeclarationError(f"enum choices must be identifiers (they go into file names), got {bad}")

    def check(self, module, name, value):
        if value not in self.choices:
            raise self._reject(module, name, value, f"one of {', '.join(self.choices)}")
        return value

    def schema(self):
        return {"type": "enum", "choices": self.choices}


# Accepted spellings of the kernel dtypes, the one table of them; torch dtypes match through str(),
# so jit/ needs no torch.
DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


@dataclass(frozen=True)
class DType(Param):
    """A storage dtype, spelled ``fp32``/``bf16``/``fp16`` in keys and templates
    (``kf::bf16`` in C++); torch dtypes and their names are accepted. The fp8 storage
    types ``fp8_e4m3`` (torch.float8_e4m3fn) and ``fp8_e5m2`` (torch.float8_e5m2) are
    accepted only where a module lists them in ``choices``."""

    choices: tuple[str, ...] = ("fp32", "bf16", "fp16")
    kind = "dtype"

    def check(self, module, name, value):
        canonical = DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
        if canonical not in self.choices:
            raise self._reject(module, name, value, f"one of {', '.join(self.choices)}")
        return canonical

    def schema(self):
        return {"type": "dtype", "choices": self.choices}


@dataclass(frozen=True)
class IntTuple(Param):
    """A fixed-length tuple of positive ints, such as a tile shape; spelled ``16x64`` in keys."""

    length: int
    choices: tuple[tuple[int, ...], ...] | None = None
    kind = "int_tuple"

    def check(self, module, name, value):
        if not isinstance(value, tuple):
            hint = " (a tuple, not a list)" if isinstance(value, list) else ""
            raise self._reject(module, name, value, f"a tuple of {self.length} ints{hint}")
        if len(value) != self.length or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise self._reject(module, name, value, f"a tuple of {self.length} positive ints")
        if self.choices is not None and value not in self.choices:
            raise self._reject(module, name, value, f"one of {', '.join(map(self.key_text, self.choices))}")
        return tuple(value)

    def key_text(self, value):
        return "x".join(map(str, value))

    def schema(self):
        return {"type": "int_tuple", "length": self.length, "choices": self.choices}


# --------------------------------------------------------------------------- entry points


def _check_identifier(what: str, name: str) -> None:
    if not _IDENTIFIER.match(name) or keyword.iskeyword(name):
        raise DeclarationError(f"{what} {name!r} is not a valid identifier")


@dataclass(frozen=True)
class Struct:
    """An argument struct: for entries with many arguments, filled by field name
    from Python (``Kernel.new``) and read by name in C++."""

    name: str
    fields: tuple[tuple[str, str], ...]  # (field, C type)

    def __post_init__(self):
        _check_identifier("struct", self.name)
        _check_fields(f"struct {self.name}", self.fields)

    def c_definition(self) -> str:
        body = " ".join(f"{ctype} {name};" for name, ctype in self.fields)
        return f"typedef struct {self.name} {{ {body} }} {self.name};"  # typedef: C (cffi) names it without `struct`


@dataclass(frozen=True)
class Codes:
    """Named integer constants that C++ and Python share (status and error codes, enum values, the
    sizes of plan layouts), declared once on the :class:`Module`: the template gets them as
    ``enum Name : int64_t { kA = 1, ... };`` (in the namespace ``name`` gives, before the headers
    that use them), Python reads ``codes.kA`` and ``codes.name_of(1)``."""

    name: str  # the C++ enum, qualified by its namespace: "kf::attention::PlanError"
    values: tuple[tuple[str, int], ...]  # (enumerator, value)

    def __post_init__(self):
        *namespaces, enum = self.name.split("::")
        for part in [*namespaces, enum]:
            _check_identifier("codes", part)
        names = [name for name, _ in self.values]
        for name in names:
            _check_identifier(f"codes {self.name}", name)
        if len(set(names)) != len(names) or len({v for _, v in self.values}) != len(names):
            raise DeclarationError(f"codes {self.name}: every enumerator and value must be distinct")

    def __getattr__(self, name: str) -> int:
        for enumerator, value in self.__dict__.get("values", ()):
            if enumerator == name:
                return value
        raise AttributeError(f"codes {self.__dict__.get('name')} have no {name!r}")

    def name_of(self, value: int) -> str:
        return next(name for name, v in self.values if v == value)

    def c_definition(self) -> str:
        *namespaces, enum = self.name.split("::")
        body = f"enum {enum} : int64_t {{ {', '.join(f'{n} = {v}' for n, v in self.values)} }};"
        for namespace in reversed(namespaces):
            body = f"namespace {namespace} {{ {body} }}"
        return body


def _check_fields(owner: str, fields: Iterable[tuple[str, str]], extra_types: tuple[str, ...] = ()) -> None:
    seen = set()
    for name, ctype in fields:
        _check_identifier(f"{owner}: argument", name)
        if name in seen:
            raise DeclarationError(f"{owner}: argument {name!r} is declared twice")
        seen.add(name)
        if ctype not in SCALAR_CTYPES + extra_types:
            raise DeclarationError(
                f"{owner}: argument {name} has C type {ctype!r}; use one of {', '.join(SCALAR_CTYPES + extra_types)}"
            )


@dataclass(frozen=True)
class Entry:
    """A named entry point: ``returns name(args...)``. Addresses travel as ``int64_t``
    (``tensor.data_ptr()``); a declared struct travels by pointer (``const S*``)."""

    name: str
    args: tuple[tuple[str, str], ...] | str  # or C's spelling: "int64_t out, double eps"
    returns: str = "void"

    def __post_init__(self):
        _check_identifier("entry", self.name)
        if isinstance(self.args, str):
            object.__setattr__(self, "args", _parse_c_args(self.name, self.args))
        if self.returns not in _RETURN_CTYPES:
            raise DeclarationError(f"entry {self.name}: return type {self.returns!r} is not one of {_RETURN_CTYPES}")

    def symbol(self, module: str) -> str:
        return f"kf_{module}_{self.name}"

    def cdecl(self, module: str) -> str:
        args = ", ".join(f"{ctype} {name}" for name, ctype in self.args) or "void"
        return f"{self.returns} {self.symbol(module)}({args})"

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.args)


def _parse_c_args(entry: str, text: str) -> tuple[tuple[str, str], ...]:
    args = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        ctype, _, name = part.rpartition(" ")
        if not ctype:
            raise DeclarationError(f"entry {entry}: argument {part!r} needs a C type and a name")
        args.append((name, " ".join(ctype.split())))
    return tuple(args)


# --------------------------------------------------------------------------- the module


# Which built tier serves each selected tier. Modules without tile code run their
# avx512 build on AMX machines: said here once, by declaration, not by a silent fallback.
VECTOR_TIERS: Mapping[str, str] = {"amx": "avx512", "avx512": "avx512", "avx2": "avx2", "generic": "generic"}
ALL_TIERS: Mapping[str, str] = {"amx": "amx", "avx512": "avx512", "avx2": "avx2", "generic": "generic"}

_registry: dict[str, Module] = {}
_registry_lock = threading.Lock()


class Module:
    """One kernel module: a template, its typed parameters, its tiers and its entry points."""

    def __init__(
        self,
        name: str,
        template: str,
        params: Mapping[str, Param],
        entries: Iterable[Entry],
        tiers: Mapping[str, str] = VECTOR_TIERS,
        structs: Iterable[Struct] = (),
        codes: Iterable[Codes] = (),
        register: bool = True,
    ):
        _check_identifier("module", name)
        self.name, self.template = name, template
        self.params = dict(params)
        for pname in self.params:
            _check_identifier(f"module {name}: parameter", pname)
        self.structs = {s.name: s for s in structs}
        self.codes = tuple(codes)
        self.entries = {e.name: e for e in entries}
        if not self.entries:
            raise DeclarationError(f"module {name} declares no entry point")
        struct_pointers = tuple(f"const {s}*" for s in self.structs)
        for entry in self.entries.values():
            _check_fields(f"module {name}, entry {entry.name}", entry.args, struct_pointers)
            if entry.symbol(name) in self.structs:
                raise DeclarationError(
                    f"module {name}: struct {entry.symbol(name)} has the C name of entry "
                    f"{entry.name}; rename the struct"
                )
        from kernforge.jit import isa  # tier names only; isa does not import modules back

        unknown = [t for t in [*tiers, *tiers.values()] if t not in isa.TIERS]
        if unknown:
            raise DeclarationError(f"module {name}: unknown tiers {unknown}; tiers are {', '.join(isa.TIER_ORDER)}")
        self.tiers = dict(tiers)
        self.cdef = "\n".join(
            [*(s.c_definition() for s in self.structs.values()), *(e.cdecl(name) + ";" for e in self.entries.values())]
        )
        self._variants: dict[tuple, Any] = {}
        self._variants_lock = threading.Lock()
        if register:
            with _registry_lock:
                _registry[name] = self

    # ---- parameters

    def checked_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` validated and normalized, in declaration order."""
        unknown = [k for k in params if k not in self.params]
        if unknown:
            raise DeclarationError(
                f"{self.name}: unknown parameter {unknown[0]!r}; it takes {', '.join(self.params) or 'none'}"
            )
        missing = [k for k in self.params if k not in params]
        if missing:
            raise DeclarationError(f"{self.name}: parameter {missing[0]!r} is missing")
        return {k: p.check(self.name, k, params[k]) for k, p in self.params.items()}

    def prefix(self, params: Mapping[str, Any], tier: str) -> str:
        """The readable part of a variant's key (checked params assumed)."""
        parts = [self.name, *(f"{k}-{p.key_text(params[k])}" for k, p in self.params.items()), tier]
        return "_".join(parts)

    def built_tier(self, selected: str) -> str:
        """The tier whose build serves ``selected`` (see ``tiers``)."""
        try:
            return self.tiers[selected]
        except KeyError:
            from kernforge.jit.isa import IsaError

            raise IsaError(
                f"module {self.name} has no variant for tier {selected!r} (it declares {', '.join(self.tiers)})"
            ) from None

    def schema(self) -> dict:
        """What a manifest entry for this module may say."""
        return {
            "module": self.name,
            "params": {k: p.schema() for k, p in self.params.items()},
            "tiers": dict(self.tiers),
        }

    # ---- rendering

    def render_variables(self, params: Mapping[str, Any], tier: str) -> dict:
        return {
            **params,
            "op": self.name,
            "tier": tier,
            # A namespace, not a dict: Jinja's `decl.get` would find dict.get before a key "get".
            "decl": SimpleNamespace(**{name: e.cdecl(self.name) for name, e in self.entries.items()}),
            "abi_structs": "\n".join(
                [*(c.c_definition() for c in self.codes), *(s.c_definition() for s in self.structs.values())]
            ),
        }

    # ---- variants

    def variant(self, **params):
        """The memoized :class:`~kernforge.jit.core.Variant` for ``params`` (values may
        be given in any accepted spelling: ``torch.bfloat16`` or ``"bf16"``)."""
        key = tuple(params.get(k) for k in self.params) if len(params) == len(self.params) else None
        return self._lookup(key, params)

    def select(self, *values):
        """Hot-path lookup: parameter values positionally, in declaration order."""
        return self._lookup(values, dict(zip(self.params, values)))

    def _lookup(self, key, params):
        try:
            found = self._variants.get(key)
        except TypeError:  # an unhashable value (a list): the check below says what is wrong
            key, found = None, None
        return found if found is not None else self._new_variant(key, params)

    def _new_variant(self, key, params):
        from kernforge.jit.core import Variant

        checked = self.checked_params(params)
        with self._variants_lock:
            canonical = tuple(checked.values())
            variant = self._variants.get(canonical) or Variant(self, checked)
            self._variants[canonical] = variant
            if key is not None:
                self._variants[key] = variant
        return variant

    def __repr__(self) -> str:
        return f"Module({self.name!r}, template={self.template!r})"


def registered(name: str) -> Module:
    """A module by name (built-in ones register when ``kernforge.ops`` is imported)."""
    try:
        return _registry[name]
    except KeyError:
        raise DeclarationError(f"unknown kernel module {name!r}; known: {', '.join(sorted(_registry))}") from None


def registered_modules() -> dict[str, Module]:
    return dict(_registry)


# --------------------------------------------------------------------------- the loaded module


@dataclass
class Kernel:
    """A loaded variant: its entry points as attributes (the raw foreign
    functions, positional, for hot paths), plus checked binding by name."""

    module: Module
    ffi: Any
    functions: dict[str, Callable] = field(repr=False)

    def __post_init__(self):
        self._struct_types = {}
        for name, fn in self.functions.items():
            setattr(self, name, fn)

    def bind(self, entry: str, **fixed) -> Callable:
        """``entry`` with the ``fixed`` arguments bound by name; the callable takes the
        others, in declaration order (positionally or by name). The names are checked
        here, once, so a plan can bind and a run can call with no per-call checks."""
        decl = self._entry(entry)
        unknown = [k for k in fixed if k not in decl.arg_names]
        if unknown:
            raise DeclarationError(
                f"{self.module.name}.{entry}() has no argument {unknown[0]!r}; it takes {', '.join(decl.arg_names)}"
            )
        free = [a for a in decl.arg_names if a not in fixed]
        call_args = ", ".join(a if a in free else f"_fixed[{a!r}]" for a in decl.arg_names)
        source = f"def {entry}({', '.join(free)}):\n    return _fn({call_args})\n"
        namespace = {"_fn": self.functions[entry], "_fixed": dict(fixed)}
        exec(source, namespace)  # a tiny generated function: one Python frame over the foreign call
        return namespace[entry]

    def call(self, entry: str, **args):
        """Call ``entry`` with every argument by name (checked)."""
        decl = self._entry(entry)
        missing = [a for a in decl.arg_names if a not in args]
        if missing:
            raise DeclarationError(f"{self.module.name}.{entry}(): argument {missing[0]!r} is missing")
        return self.bind(entry, **args)()

    def new(self, struct: str, fields: Mapping[str, Any] = {}):  # noqa: B006  (read only)
        """A declared struct with ``fields`` (a mapping of field name to value) set, the
        others 0. cffi fills it from the mapping in C; unknown names raise."""
        try:
            return self.ffi.new(self._struct_types[struct], fields)
        except KeyError:
            if struct in self._struct_types:
                self._explain_struct_error(struct, fields)
                raise
            if struct not in self.module.structs:
                raise DeclarationError(f"{self.module.name} declares no struct {struct!r}") from None
            self._struct_types[struct] = self.ffi.typeof(f"{struct}*")
            return self.new(struct, fields)
        except (TypeError, OverflowError):
            self._explain_struct_error(struct, fields)
            raise

    def _explain_struct_error(self, struct: str, fields: Mapping[str, Any]) -> None:
        known = dict(self.module.structs[struct].fields)
        for name, value in fields.items():
            if name not in known:
                raise DeclarationError(f"struct {struct} has no field {name!r}; fields: {', '.join(known)}") from None
            try:
                self.ffi.new(self._struct_types[struct], {name: value})
            except (TypeError, OverflowError) as exc:
                raise TypeError(f"struct {struct}: field {name} ({known[name]}) cannot take {value!r}: {exc}") from None

    def address(self, cdata) -> int:
        """The address of a cffi object, for an ``int64_t`` argument."""
        return int(self.ffi.cast("intptr_t", cdata))

    def _entry(self, entry: str) -> Entry:
        try:
            return self.module.entries[entry]
        except KeyError:
            raise DeclarationError(
                f"{self.module.name} has no entry point {entry!r}; it has {', '.join(self.module.entries)}"
            ) from None
