"""The precompute progress line an operator reads in a task's log."""

from cagflow.offline.precompute import progress_line


def test_progress_line_shows_the_bar_rate_and_time_left():
    assert progress_line("faq", 1024, 4096, 2.0, width=8) == "faq [##......] 1024/4096 tokens · 512 tok/s · ETA 6 s"
    assert progress_line("faq", 4096, 4096, 8.0, width=8) == "faq [########] 4096/4096 tokens · 512 tok/s · done in 8.0 s"
