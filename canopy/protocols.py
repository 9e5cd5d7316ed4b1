"""What a class lacks of a `typing.Protocol`: the check behind "every member is required" (the `Engine` and
`Environment` protocols), run on a user's environment when it is loaded and on each of Canopy's in the tests. A leaf
module: it imports nothing from Canopy."""

import inspect


def protocol_members(protocol: type) -> dict[str, inspect.Signature | None]:
    """A Protocol's own members: its annotated attributes (None) and its public methods (their signatures). Python
    3.11 has no `typing.get_protocol_members`."""
    members: dict[str, inspect.Signature | None] = dict.fromkeys(protocol.__annotations__)
    for name, value in vars(protocol).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            members[name] = inspect.signature(value)
    return members


def declared(cls: type, name: str) -> bool:
    """Whether `cls` declares the attribute `name`: a class attribute or property, or an annotation of its own or a
    base's (an attribute that `__init__` sets is declared by its annotation)."""
    return any(name in vars(k) or name in vars(k).get("__annotations__", {}) for k in cls.__mro__[:-1])


def _shape(signature: inspect.Signature) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in signature.parameters.values()]


def mismatches(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks of `protocol`, or declares with another signature (parameter names and kinds), one line
    each: empty when `cls` implements it."""
    wrong = []
    for name, signature in protocol_members(protocol).items():
        if signature is None:
            if not declared(cls, name):
                wrong.append(f"{cls.__qualname__}.{name} is not declared")
            continue
        method = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(method):
            wrong.append(f"{cls.__qualname__}.{name}() is not a method")
        elif _shape(inspect.signature(method)) != _shape(signature):
            wrong.append(f"{cls.__qualname__}.{name}{inspect.signature(method)} is not {name}{signature}")
    return wrong
