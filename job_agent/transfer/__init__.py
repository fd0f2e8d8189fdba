"""State transfer between ranks: a rank's state as bytes, the donor's and the receiver's side."""
