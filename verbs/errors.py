"""The two exception types of the verbs library (pyverbs' PyverbsRDMAError / PyverbsUserError).

Control-path verbs that the daemon refuses raise ``VerbsError`` with an
errno; mistakes the library can see without asking the daemon (wrong types,
``num_sge`` larger than the SGE list, using a closed object) raise
``UserError``.  Data-path failures are never exceptions: they are
``WC.status``.  A blocking wait that runs out of time raises the built-in
``TimeoutError``.
"""

from __future__ import annotations

import errno as _errno
import os


class VerbsError(Exception):
    """A verb failed; ``error_code`` is the errno (as PyverbsRDMAError)."""

    def __init__(self, msg: str, error_code: int = _errno.EINVAL, private_data: bytes = b"") -> None:
        name = _errno.errorcode.get(error_code, str(error_code))
        super().__init__(f"{msg}. Errno: {error_code}, {name}: {os.strerror(error_code)}")
        self.error_code = error_code
        self.errno = error_code
        #: private data of a connection the peer rejected (rdma_cm REJECTED)
        self.private_data = private_data


class ConnectionRejected(VerbsError):
    """The listening application rejected the connection (rdma_cm's
    RDMA_CM_EVENT_REJECTED with the consumer's reject): ``error_code`` is
    ECONNABORTED, ``private_data`` the reject's.  Nobody listening raises a
    plain ``VerbsError`` with ECONNREFUSED instead, as TCP's ``connect`` does,
    since listening later may still change the answer."""


class UserError(Exception):
    """The caller misused the API (as PyverbsUserError)."""


PyverbsRDMAError = VerbsError
PyverbsUserError = UserError
