package framework

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics is one scrape of a page in the Prometheus text format, as a
// broker's or an agent's /metrics serves it.
type Metrics struct {
	// Text is the page as served.
	Text     string
	families map[string]*dto.MetricFamily
}

// scrapeClient bounds a scrape of a process that accepts connections but
// does not answer yet, such as a broker that waits for its informers.
var scrapeClient = &http.Client{Timeout: 10 * time.Second}

// ScrapeMetrics reads http://addr/metrics.
func ScrapeMetrics(ctx context.Context, addr string) (*Metrics, error) {
	if addr == "" {
		return nil, fmt.Errorf("framework: scrape metrics: no address (is the metrics listener disabled?)")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := scrapeClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("framework: scrape %s: %w", addr, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("framework: scrape %s: %w", addr, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("framework: scrape %s: %s", addr, resp.Status)
	}
	return ParseMetrics(string(raw))
}

// ParseMetrics parses a page in the Prometheus text format.
func ParseMetrics(text string) (*Metrics, error) {
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		return nil, fmt.Errorf("framework: parse metrics: %w", err)
	}
	return &Metrics{Text: text, families: families}, nil
}

// Sum returns the sum of the samples of the metric name whose labels
// include every one of labels, each written name="value" (`code="OK"`): a
// counter's, gauge's or untyped metric's value, a histogram's or summary's
// count of observations. It is 0 when there is no such sample.
func (m *Metrics) Sum(name string, labels ...string) float64 {
	var sum float64
	for _, s := range m.families[name].GetMetric() {
		if pairs := labelPairs(s); !slices.ContainsFunc(labels, func(l string) bool { return !slices.Contains(pairs, l) }) {
			sum += value(s)
		}
	}
	return sum
}

// ByLabels returns the values of the metric name by their labels, each
// key the labels written name="value" and joined by commas.
func (m *Metrics) ByLabels(name string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range m.families[name].GetMetric() {
		out[strings.Join(labelPairs(s), ",")] += value(s)
	}
	return out
}

// Has reports whether the page exposes name: a metric, or the _bucket,
// _sum or _count series of a histogram or summary.
func (m *Metrics) Has(name string) bool {
	if _, ok := m.families[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if !ok {
			continue
		}
		if f, ok := m.families[base]; ok && (f.GetType() == dto.MetricType_HISTOGRAM || f.GetType() == dto.MetricType_SUMMARY) {
			return suffix != "_bucket" || f.GetType() == dto.MetricType_HISTOGRAM
		}
	}
	return false
}

// value is a counter's, gauge's or untyped metric's value, or a
// histogram's or summary's count of observations.
func value(s *dto.Metric) float64 {
	switch {
	case s.GetCounter() != nil:
		return s.GetCounter().GetValue()
	case s.GetGauge() != nil:
		return s.GetGauge().GetValue()
	case s.GetUntyped() != nil:
		return s.GetUntyped().GetValue()
	case s.GetHistogram() != nil:
		return float64(s.GetHistogram().GetSampleCount())
	case s.GetSummary() != nil:
		return float64(s.GetSummary().GetSampleCount())
	}
	return 0
}

// labelPairs writes each label of s as name="value".
func labelPairs(s *dto.Metric) []string {
	pairs := make([]string, 0, len(s.GetLabel()))
	for _, l := range s.GetLabel() {
		pairs = append(pairs, l.GetName()+`="`+l.GetValue()+`"`)
	}
	return pairs
}
