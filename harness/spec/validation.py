"""Turn pydantic validation errors into located problems (file:line:col, key path, expectation)."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from harness.errors import Problem, SpecError
from harness.spec.yamlsource import Document, KeyPath, YamlFloat, YamlInt, as_written

Model = TypeVar("Model", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for every file-backed model: unknown keys are errors and values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def error_at(model: str, loc: KeyPath, value: Any, message: str) -> ValidationError:
    """A problem a model's own validator finds at one of its keys (a rule across keys), located at that
    key rather than at the model."""
    return ValidationError.from_exception_data(
        model, [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=value)])


def _known_keys(model: type[BaseModel], loc: KeyPath) -> list[str]:
    """Field names of the (nested) model that owns loc, for 'did you mean' hints."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", {})
        if part not in fields:
            return []
        annotation = fields[part].annotation
        current = _model_in(annotation)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation such as `Foo | None` or `list[Foo]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _message(model: type[BaseModel], error: ErrorDetails, loc: KeyPath) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _known_keys(model, loc)
        hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        text = f"unknown key {loc[-1]!r}"
        if hint:
            text += f" (did you mean {hint[0]!r}?)"
        return text + (f"; expected one of: {', '.join(known)}" if known else "")
    if kind == "missing":
        return "required key is missing"
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if kind in {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type"}:
        value = error.get("input")
        kind = {YamlInt: "int", YamlFloat: "float"}.get(type(value), type(value).__name__)
        message += f", got {kind} {as_written(value)}"
    return message


def validate(model: type[Model], doc: Document, at: KeyPath = (), data: Any = None) -> Model:
    """Validate the value at key path `at` (or `data` standing for it); every problem is located."""
    value = doc.data if data is None else data
    if not isinstance(value, dict):
        raise SpecError([doc.problem(at, "expected a mapping of keys")])
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [(tuple(part for part in error["loc"] if part != "[key]"), error) for error in exc.errors()]
        # A misspelt key first: its "did you mean" is why the key it meant is missing, which is left unsaid.
        meant = {(*loc[:-1], hint[0]) for loc, error in errors if error["type"] == "extra_forbidden"
                 if (hint := difflib.get_close_matches(str(loc[-1]), _known_keys(model, loc), n=1))}
        errors.sort(key=lambda item: item[1]["type"] != "extra_forbidden")
        problems = [doc.problem(at + loc, _message(model, error, loc)) for loc, error in errors
                    if not (error["type"] == "missing" and loc in meant)]
        raise SpecError(_unique(problems)) from None


def _unique(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    result = []
    for problem in problems:
        if str(problem) not in seen:
            seen.add(str(problem))
            result.append(problem)
    return result
