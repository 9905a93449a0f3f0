import faiss
import pytest


@pytest.fixture(autouse=True, scope="session")
def _faiss_single_thread():
    """Run FAISS single-threaded in tests: on the shared 2-core machine libgomp's spin-waiting
    threads make tiny HNSW adds ~50x slower under load. Tests check results, not speed."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
