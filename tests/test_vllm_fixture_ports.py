"""The vLLM fixture's ports: free, and out of the range connections take theirs from."""
import socket

from fixtures.vllm_engine import BELOW_EPHEMERAL_FROM, ephemeral_range, free_port


def test_ports_for_vllm_are_free_and_below_the_ephemeral_range():
    """vLLM binds its KV-event ports long after it starts; a port from the
    ephemeral range may be a connection's by then ("Address already in use")."""
    low, high = ephemeral_range()
    assert low <= high
    for _ in range(20):
        port = free_port()
        if low > BELOW_EPHEMERAL_FROM + 100:
            assert BELOW_EPHEMERAL_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
