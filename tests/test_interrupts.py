"""Ctrl-C is never lost in the store's finalizers.

Python ignores an exception raised in a finalizer, and a SIGINT's KeyboardInterrupt is raised
wherever the main thread runs Python when the signal is handled. The store runs finalizers for
every tensor autograd saves (the saved-activation meter on a CPU device, the activation
offload), so a Ctrl-C used to be swallowed there now and then and training went on. These
tests make the interrupt land inside those finalizers every time, and check that it still
stops the loop."""

from __future__ import annotations

import gc
import signal
import time

import pytest
import torch
from torch import nn

import infinity
from infinity.core.finalizers import interrupt_safe
from infinity.observability.saved_activations import SavedActivationMeter
from infinity.training.activations import ActivationOffload


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """As in a user's process (pytest-xdist's workers ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _spin(seconds: float = 30.0) -> None:
    """Plain Python work, where a pending interrupt is raised (the bound only ends a wait for
    one that never comes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_an_interrupt_raised_in_a_wrapped_finalizer_is_raised_again_after_it():
    ran = []

    class Owner:
        @interrupt_safe
        def __del__(self) -> None:
            ran.append(True)
            raise KeyboardInterrupt

    # No other finalizer may run while it is pending (one would swallow it just the same):
    # earlier tests' garbage goes first, and the collector stays off until it is raised.
    gc.collect()
    gc.disable()
    try:
        owner = Owner()
        with pytest.raises(KeyboardInterrupt):
            del owner
            _spin()
    finally:
        gc.enable()
    assert ran == [True]


def test_an_interrupt_asked_again_while_another_finalizer_runs_is_not_lost():
    """The interrupt a wrapped finalizer left pending is asked for again a moment later; when
    that lands in a finalizer nobody wrapped (torch's, a library's), Python swallows it too."""

    class Owner:
        @interrupt_safe
        def __del__(self) -> None:
            raise KeyboardInterrupt

    class Plain:
        def __del__(self) -> None:
            _spin(5.0)  # the interrupt asked again lands in here

    gc.collect()
    gc.disable()
    try:
        owner, plain = Owner(), Plain()
        with pytest.raises(KeyboardInterrupt):
            del owner  # caught and left pending: asked again in REDELIVER_AFTER_S
            del plain
            _spin()
    finally:
        gc.enable()


def _interrupt_once(original, exc: BaseException | type[BaseException] = KeyboardInterrupt):
    calls = []

    def finalizer(self, *args):
        original(self, *args)
        if not calls:
            calls.append(True)
            raise exc  # as a signal handled right here would

    return finalizer


def _train(tmp_path, **config) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    store = infinity.TieredStore(
        infinity.OffloadConfig(device="cpu", nvme_path=str(tmp_path), **config)
    )
    model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
    try:
        for _ in range(3):
            # activations of 512 KiB: offloaded
            model(torch.randn(512, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        _spin()  # a loop that runs none of the store's hooks still gets it
    finally:
        store.close()


def test_ctrl_c_landing_in_the_saved_activation_meter_stops_training(tmp_path, monkeypatch):
    monkeypatch.setattr(
        SavedActivationMeter, "_let_go", _interrupt_once(SavedActivationMeter._let_go)
    )
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path)


def test_ctrl_c_landing_in_the_activation_offload_s_finalizer_stops_training(tmp_path, monkeypatch):
    monkeypatch.setattr(ActivationOffload, "_on_dead", _interrupt_once(ActivationOffload._on_dead))
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, offload_activations="cpu")


def test_a_sigterm_handler_s_exit_landing_in_a_finalizer_still_ends_training(tmp_path, monkeypatch):
    """A user's SIGTERM handler raises SystemExit: it keeps its exit code."""
    monkeypatch.setattr(
        SavedActivationMeter,
        "_let_go",
        _interrupt_once(SavedActivationMeter._let_go, SystemExit(3)),
    )
    with pytest.raises(SystemExit) as raised:
        _train(tmp_path)
    assert raised.value.code == 3
