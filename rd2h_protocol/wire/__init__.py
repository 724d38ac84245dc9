"""What travels between Prefill and Decode, as bytes.

* :mod:`~rd2h_protocol.wire.messages`: the typed messages (msgspec ``array_like`` Structs in
  v1's field order, v2 fields appended), their bounds and the protocol constants;
* :mod:`~rd2h_protocol.wire.codec`: ``encode`` / ``decode`` (bounded: a frame a peer sends
  can only ever raise :class:`~rd2h_protocol.errors.RemoteProtocolError`);
* :mod:`~rd2h_protocol.wire.layout`: a layer's tensors as MF_META carries them and the
  validation of a Prefill layout against Decode's destination.

The names are exported from :mod:`rd2h_protocol` itself; import them from there.
"""
