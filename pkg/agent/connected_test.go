package agent

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// An agent whose second broker target never admits a stream is never
// connected, and asking whether it is must not leave a goroutine behind.
func TestConnectedLeaksNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t)

	admits := func(ctx context.Context, _ string, connected func()) error {
		connected()
		<-ctx.Done()
		return nil
	}
	refuses := func(ctx context.Context, _ string, _ func()) error {
		<-ctx.Done()
		return nil
	}
	a := &Agent{}
	a.addTarget(newFanout("10.0.0.1:8444", time.Hour, nil, admits, logr.Discard()))
	a.addTarget(newFanout("10.0.0.2:8444", time.Hour, nil, refuses, logr.Discard()))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, len(a.targets))
	for _, f := range a.targets {
		go func() {
			defer func() { done <- struct{}{} }()
			_ = f.Run(ctx)
		}()
	}
	<-a.targets[0].connected
	for range 3 {
		select {
		case <-a.Connected():
			t.Fatal("connected while a broker target has no stream")
		default:
		}
	}
	cancel()
	for range a.targets {
		<-done
	}
	select {
	case <-a.Connected():
		t.Fatal("connected while a broker target has no stream")
	default:
	}
}

// Connected closes once every target has admitted a stream.
func TestConnectedOnceEveryTargetIs(t *testing.T) {
	a := &Agent{}
	var marks []func()
	for _, addr := range []string{"10.0.0.1:8444", "10.0.0.2:8444"} {
		f := newFanout(addr, time.Hour, nil, nil, logr.Discard())
		a.addTarget(f)
		marks = append(marks, f.markConnected)
	}
	connected := a.Connected()
	marks[0]()
	marks[0]() // twice: a second stream of the same target
	select {
	case <-connected:
		t.Fatal("connected with one target of two")
	default:
	}
	marks[1]()
	select {
	case <-connected:
	default:
		t.Fatal("not connected with every target")
	}
	require.Equal(t, connected, a.Connected(), "one channel for every caller")
}
