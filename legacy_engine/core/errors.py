"""One exception tree for the engine. Each class mixes in the builtin a caller would expect."""


class EngineError(Exception):
    """Base of every error legacy_engine raises on purpose."""


class FormatError(ValueError, EngineError):
    """A model file (or other input) is malformed; the message names the key or tensor."""


class ContextLengthError(ValueError, EngineError):
    """A prompt (or a generation) does not fit the context."""


class UnavailableError(RuntimeError, EngineError):
    """A path, feature or optional library is not available on this machine or build."""


class NativeError(RuntimeError, EngineError):
    """The C core returned an error status; the message carries its file:line."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class PlanningError(ValueError, EngineError):
    """A placement does not fit the VRAM budget (or no strategy can run); the message names the parts."""


class TemplateRenderError(ValueError, EngineError):
    """A chat template failed: it does not parse, raised, ran too long or produced too much; the message names the
    template."""


class Cancelled(EngineError):
    """A caller's cancel() stopped a prefill between chunks; the session holds the chunks already run."""
