"""wire layer of udpverbs: every byte layout, declared once.

Each module holds a ``construct`` declaration (the reference) and a
``struct`` fast path that the tests hold to it.  Decoders fed network bytes
are named ``*_untrusted`` and raise only ``errors.WireError(reason)``.

On a link, a datagram is ``link`` header + body + CRC32c (``crc``); a body
is an ``envelope`` (kind, destination QPN, source QPN) and, by kind:

* ``Kind.DDP``: one DDP segment (``ddp``, RFC 5041) carrying RDMAP
  (``rdmap``, RFC 5040 + RFC 7306); ``segment`` decodes envelope + segment
  header in one step for the receive loop and packs them for the send loop;
* ``Kind.CM``: connection management (``cm``);
* ``Kind.FLOW``: QP-level Modified ACK/NACK (``flow``);
* ``Kind.LOCK`` / ``Kind.BARRIER``: queue lock and tree barrier (``lock``,
  ``barrier``).

Between the verbs library and its daemon: ``shm`` (shared-memory rings) and
``ctl`` (control messages on the unix socket).
"""
