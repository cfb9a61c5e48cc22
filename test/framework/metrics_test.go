package framework_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/test/framework"
)

func TestMetrics(t *testing.T) {
	raw, err := os.ReadFile("testdata/metrics-page-of-a-broker.txt")
	require.NoError(t, err)
	m, err := framework.ParseMetrics(string(raw))
	require.NoError(t, err)

	for _, tt := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{name: "credbroker_exchanges_total", want: 6},
		{name: "credbroker_exchanges_total", labels: []string{`code="OK"`}, want: 5},
		{name: "credbroker_exchanges_total", labels: []string{`cache="miss"`, `code="OK"`}, want: 2},
		{name: "credbroker_exchanges_total", labels: []string{`code="O"`}, want: 0},
		{name: "credbroker_exchanges_total", labels: []string{`code="OK"`, `zone="a"`}, want: 0},
		{name: "credbroker_connected_clusters", want: 2},
		{name: "credbroker_exchange_duration_seconds", want: 6},
		{name: "go_gc_duration_seconds", want: 7},
		{name: "absent", want: 0},
	} {
		assert.Equal(t, tt.want, m.Sum(tt.name, tt.labels...), "%s%v", tt.name, tt.labels)
	}

	assert.Equal(t, map[string]float64{
		`cache="hit",code="OK"`: 3, `cache="miss",code="OK"`: 2, `cache="miss",code="PermissionDenied"`: 1,
	}, m.ByLabels("credbroker_exchanges_total"))

	for name, want := range map[string]bool{
		"credbroker_connected_clusters":               true,
		"credbroker_exchange_duration_seconds_bucket": true,
		"credbroker_exchange_duration_seconds_count":  true,
		"go_gc_duration_seconds_sum":                  true,
		"go_gc_duration_seconds_bucket":               false,
		"credbroker_connected_clusters_count":         false,
		"absent":                                      false,
	} {
		assert.Equal(t, want, m.Has(name), name)
	}
	assert.Contains(t, m.Text, "credbroker_connected_clusters 2")

	_, err = framework.ParseMetrics("credbroker_exchanges_total{ 1\n")
	assert.Error(t, err)
}
