"""The model checker of RD2H: the real endpoints in a simulated world, checked everywhere.

The core (:mod:`rd2h_protocol`) never imports this package; the docs generator and the
tests do.
"""
