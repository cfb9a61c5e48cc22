package client_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/client"
)

// A controller on the hub lists namespaces on a spoke. In a pod, Address is
// the broker's Service, Roots verify it, and the token file is a projected
// ServiceAccount token with audience "credbroker".
func Example() {
	broker, err := startFakeBroker(clock.RealClock{}, time.Hour)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer broker.Close()
	ctx := context.Background()

	tokens, err := client.NewFileTokenSource(broker.TokenFile, 0, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	c, err := client.New(client.Config{
		Address:     broker.Address, // "credbroker.credbroker-system.svc:8443"
		TLS:         &tls.Config{RootCAs: broker.Roots, MinVersion: tls.VersionTLS12},
		TokenSource: tokens, // "/var/run/secrets/credbroker/token"
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = c.Close() }()

	cfg, err := c.RESTConfigFor(ctx, "fleet", "prod-eu-1")
	if err != nil {
		fmt.Println(err)
		return
	}
	spoke, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	list, err := spoke.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, ns := range list.Items {
		fmt.Println(ns.Name)
	}
	// Output:
	// default
	// kube-system
}
