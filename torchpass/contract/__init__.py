"""The YOCO contract: its terms and rules, its ledger and what it checks before counting, the credit
and its notice to billing, and what failures cost. Pure."""
