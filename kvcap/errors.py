"""kvcap's own exception types: each carries a one-line message meant for the user."""

from __future__ import annotations


class KvcapError(Exception):
    """Base class; the CLI prints these as one line and exits non-zero."""


class ConfigError(KvcapError, ValueError):
    """A configuration or user input is invalid."""


class ModelLoadError(KvcapError):
    """A checkpoint cannot be found, read or matched to its architecture."""


class ScaleGateError(KvcapError):
    """The E4M3 startup gate refused: K/V scales missing or invalid."""


class OverlayError(KvcapError):
    """A scale overlay cannot be written, verified or materialized."""


class CalibrationError(KvcapError):
    """Calibration found non-finite activations or missing layers."""


class DecoderCheckError(KvcapError):
    """The E4M3 conversions this GPU would run did not decode every code exactly."""
