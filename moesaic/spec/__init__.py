"""Speculative decoding: draft proposers (n-gram, MTP, DSpark, DFlash) behind one small interface, and the
verification the engine runs (one target forward over each drafting sequence's [last, d1..dk], exact
acceptance, rollback of every rejected row in every state kind)."""
