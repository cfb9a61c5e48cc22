package agent

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

func TestJudgeWaitsForTheThreshold(t *testing.T) {
	steps := []struct {
		msg            string
		ready, reports bool
	}{
		{"", true, true},
		{"etcd", false, false},
		{"etcd", false, false},
		{"etcd", false, true},
		{"etcd", false, true},
		{"", true, true},
		{"etcd", false, false},
	}
	j := judge{threshold: 3}
	for i, s := range steps {
		ready, report := j.observe(s.msg)
		assert.Equal(t, s.reports, report, "step %d", i)
		if report {
			assert.Equal(t, s.ready, ready, "step %d", i)
		}
	}
}

func TestReadyzNamesTheFailedChecks(t *testing.T) {
	cases := []struct {
		name   string
		status int
		body   string
		want   string
	}{
		{"ready", http.StatusOK, "ok", ""},
		{"a failed check", http.StatusInternalServerError,
			"[+]ping ok\n[-]etcd failed: reason withheld\n[+]informer-sync ok\nreadyz check failed\n",
			"/readyz reports [-]etcd failed: reason withheld"},
		{"no check named", http.StatusServiceUnavailable, "shutting down", "/readyz: "},
		{"a long answer", http.StatusInternalServerError, "[-]" + strings.Repeat("é", 1000), "/readyz reports [-]éé"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				assert.Equal(t, "/readyz", r.URL.Path)
				w.WriteHeader(c.status)
				_, _ = w.Write([]byte(c.body))
			}))
			defer srv.Close()
			client, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
			require.NoError(t, err)
			got := readyz(context.Background(), client.Discovery().RESTClient(), time.Minute)
			if c.want == "" {
				assert.Empty(t, got)
				return
			}
			assert.True(t, strings.HasPrefix(got, c.want), got)
			assert.LessOrEqual(t, len(got), maxSpokeHealthMessage+len("..."))
			assert.True(t, strings.ToValidUTF8(got, "") == got, "clipped on a rune boundary")
		})
	}
}
