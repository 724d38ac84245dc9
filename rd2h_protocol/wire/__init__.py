"""What travels between Prefill and Decode, as bytes.

* :mod:`~rd2h_protocol.wire.messages`: the typed messages (msgspec ``array_like`` Structs in
  v1's field order, v2 fields appended), their bounds and the protocol constants;
* :mod:`~rd2h_protocol.wire.codec`: ``encode`` / ``decode`` (bounded: a frame a peer sends
  can only ever raise :class:`~rd2h_protocol.errors.RemoteProtocolError`);
* :mod:`~rd2h_protocol.wire.readiness`: ``read_frame``, the one call that reads a frame
  from Prefill on Decode, with a readiness's block ids checked against the session's
  bound and a step's entries decoded once; a refused frame comes back with what it names;
* :mod:`~rd2h_protocol.wire.layout`: a layer's tensors as MF_META carries them and the
  validation of a Prefill layout against Decode's destination.

The names are exported from :mod:`rd2h_protocol` itself (those of ``readiness``, which
serve a Decode endpoint, from their module); import them from there.
"""
