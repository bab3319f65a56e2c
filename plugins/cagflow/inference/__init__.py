"""What runs inside Triton: the answer service, the resident snapshot set, the answer cache, and the
Triton adapter (the only code that touches ``pb_utils``)."""
