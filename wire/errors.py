"""The one error type that decoders fed untrusted bytes may raise."""


class WireError(ValueError):
    """Bytes that do not form a valid message of the expected layout.

    ``reason`` is a short, stable token (``"truncated"``, ``"bad_crc"``, ...)
    that receivers use as the key of their drop counters.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
