package metrics

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/credbroker/credbroker/internal/version"
)

// BuildInfo returns the gauge name{version,revision,goversion}, always 1.
func BuildInfo(name, help string) prometheus.Collector {
	v := version.Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        name,
		Help:        help,
		ConstLabels: prometheus.Labels{"version": v.Version, "revision": v.Revision, "goversion": v.GoVersion},
	})
	g.Set(1)
	return g
}

// SVIDExpiry returns a gauge of the NotAfter of the leaf of src's current
// X.509-SVID, in seconds since the epoch, read at every scrape, so that it
// follows each rotation. Without an SVID it is 0, which an "expires within
// 15 minutes" alert takes for expired.
func SVIDExpiry(name, help string, src x509svid.Source) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
		svid, err := src.GetX509SVID()
		if err != nil || svid == nil || len(svid.Certificates) == 0 {
			return 0
		}
		return float64(svid.Certificates[0].NotAfter.Unix())
	})
}

// Register registers every collector in reg, or in a private registry when
// reg is nil (counted, exposed nowhere), and reports every failure: a
// collector registered twice means two services share a Registerer.
func Register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	var errs []error
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("register metrics: %w", err)
	}
	return nil
}
