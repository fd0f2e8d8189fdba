"""Workflow ids: different (customer, contract) or (job, domain, generation) never share one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from torchpass.ids import contract_workflow_id, incident_workflow_id, validation_workflow_id

_IDS = st.text(alphabet="ab-_:./%", min_size=1, max_size=6)


def test_ids_that_share_separators_do_not_collide() -> None:
    assert contract_workflow_id("acme-labs", "c1") != contract_workflow_id("acme", "labs-c1")
    assert contract_workflow_id("a:b", "c") != contract_workflow_id("a_b", "c")
    assert validation_workflow_id("a", "b", "j") != validation_workflow_id("x", "b", "j")
    assert incident_workflow_id("job-a", "node", 0) != incident_workflow_id("job", "a-node", 0)


@given(_IDS, _IDS, _IDS, _IDS)
def test_contract_ids_are_injective(c1: str, k1: str, c2: str, k2: str) -> None:
    assert (contract_workflow_id(c1, k1) == contract_workflow_id(c2, k2)) == ((c1, k1) == (c2, k2))


@given(_IDS, _IDS, st.integers(0, 3), _IDS, _IDS, st.integers(0, 3))
def test_incident_ids_are_injective_and_hold_no_slash(
    j1: str, d1: str, g1: int, j2: str, d2: str, g2: int
) -> None:
    a, b = incident_workflow_id(j1, d1, g1), incident_workflow_id(j2, d2, g2)
    assert (a == b) == ((j1, d1, g1) == (j2, d2, g2))
    assert "/" not in a  # an incident id is "<workflow id>/<run id>"


@given(st.text(max_size=20))
def test_id_parts_are_encoded_exactly_as_urllib_quotes_them(text: str) -> None:
    """Ids already in Temporal were made with `urllib.parse.quote(safe="")`: they must not
    change."""
    from urllib.parse import quote

    assert (
        contract_workflow_id(text or "x", "k")
        == f"torchpass-contract:{quote(text or 'x', safe='')}:k"
    )
