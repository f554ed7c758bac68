"""The one error the protocol package raises."""


class ProtocolError(ValueError):
    """A message or value the compute protocol cannot carry: a malformed protobuf message
    (a missing oneof, an unknown enum value, a negative time, a predicate whose value does
    not fit its op), a model value the wire cannot hold (an int outside int64), or bytes
    that are not an Arrow IPC stream. The message says what is wrong and where."""
