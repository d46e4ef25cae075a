"""The error hierarchy of ep-jit."""

from __future__ import annotations

__all__ = ["CompileError", "JitError", "LaunchError", "NoDeviceError"]


class JitError(RuntimeError):
    """Base class of every ep-jit error."""


class CompileError(JitError):
    """The compiler rejected the source. ``.output`` holds the compiler's full output, ``.command`` the command."""

    def __init__(self, message: str, *, output: str = "", command: str = "", log_path: str | None = None):
        super().__init__(message)
        self.output = output
        self.command = command
        self.log_path = log_path


class NoDeviceError(JitError):
    """No CUDA driver or no GPU where one is needed (load, launch, arch detection)."""


class LaunchError(JitError):
    """A module load, function lookup or kernel launch failed in the driver."""
