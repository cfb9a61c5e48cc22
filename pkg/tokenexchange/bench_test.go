package tokenexchange

import (
	"io"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
)

// The benchmarks of the cached path, piece by piece, for benchstat: run
// `go test -run '^$' -bench . -benchmem -count 6 ./pkg/tokenexchange/`
// before and after a change (make bench-go).

// BenchmarkTokenKey is the token cache key of every exchange.
func BenchmarkTokenKey(b *testing.B) {
	ref := fleet.ClusterRef{UID: "3f2b6c1e-5d7a-4e8b-9c0d-1a2b3c4d5e6f"}
	ref.Namespace, ref.Name = "fleet", "spoke-1"
	user := hubauth.User{Username: "system:serviceaccount:argocd:argocd-application-controller", UID: "8d3c1b2a-0f9e-4d8c-b7a6-5e4f3d2c1b0a",
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:argocd", "system:authenticated"}}
	r := request{audiences: []string{"https://kubernetes.default.svc"}}
	b.ReportAllocs()
	for b.Loop() {
		_ = tokenKey(ref, user, r)
	}
}

// BenchmarkAudit is the audit line of one cached exchange, encoded as the
// broker binary writes it (Config.AuditLog) to a discarding writer.
func BenchmarkAudit(b *testing.B) {
	f := newFixture(b, func(c *Config) { c.AuditLog = io.Discard })
	ctx := withBearer(consumerToken)
	req := fleetA()
	rec := &auditRecord{}
	_, err := f.svc.exchange(ctx, req, rec)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		f.svc.audit(t0, rec, req, nil, time.Millisecond)
	}
}

// BenchmarkExchangeCached is a whole cached exchange, without gRPC: with
// the audit line discarded, encoded as the broker binary does and
// discarded, and written to a file in each --audit-log-mode.
func BenchmarkExchangeCached(b *testing.B) {
	file := func(mode string) func(b *testing.B) io.Writer {
		return func(b *testing.B) io.Writer {
			a := cmdflags.AuditFlags{Path: filepath.Join(b.TempDir(), "audit.log"), MaxSize: 100, Mode: mode}
			w, err := a.Open()
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = w.Close() })
			return w
		}
	}
	for _, bc := range []struct {
		name  string
		audit func(b *testing.B) io.Writer
	}{
		{"audit=discard", func(*testing.B) io.Writer { return nil }},
		{"audit=json", func(*testing.B) io.Writer { return io.Discard }},
		{"audit=file-blocking", file(cmdflags.AuditBlocking)},
		{"audit=file-batch", file(cmdflags.AuditBatch)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			audit := bc.audit(b)
			f := newFixture(b, func(c *Config) { c.Audit, c.AuditLog = logr.Discard(), audit })
			ctx := withBearer(consumerToken)
			if _, err := f.svc.Exchange(ctx, fleetA()); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				req := fleetA()
				for pb.Next() {
					if _, err := f.svc.Exchange(ctx, req); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
