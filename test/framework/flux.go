package framework

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// FluxKubeConfigOptions mirrors fluxcd/pkg runtime/client
// KubeConfigOptions, which kustomize-controller and helm-controller set from
// their flags --insecure-kubeconfig-exec and --insecure-kubeconfig-tls.
type FluxKubeConfigOptions struct {
	// InsecureExecProvider keeps the kubeconfig's user.exec
	// (--insecure-kubeconfig-exec); without it Flux drops it.
	InsecureExecProvider bool
	// InsecureTLS keeps insecure-skip-tls-verify (--insecure-kubeconfig-tls).
	InsecureTLS bool
}

// FluxRESTConfig is the client configuration that Flux builds for a
// Kustomization or HelmRelease whose spec.kubeConfig.secretRef names secret,
// as of fluxcd/pkg runtime v0.110.1 (kustomize-controller v1.9.4,
// helm-controller v1.6.3): the kubeconfig is the Secret's key (secretRef.key)
// when given, else its "value" key, else its "value.yaml" key; clientcmd
// reads it (current context); then Flux keeps only the host, API path,
// compression, TLS server name, CA, client certificate and key, transport
// wrapper, proxy, basic auth and bearer token, plus user.exec and
// insecure-skip-tls-verify when opts allow them, with a 30 s timeout.
func FluxRESTConfig(secret *corev1.Secret, key string, opts FluxKubeConfigOptions) (*rest.Config, error) {
	name := secret.Namespace + "/" + secret.Name
	var kubeconfig []byte
	switch {
	case key != "":
		if kubeconfig = secret.Data[key]; kubeconfig == nil {
			return nil, fmt.Errorf("framework: flux: KubeConfig secret '%s' does not contain a '%s' key with a kubeconfig", name, key)
		}
	case secret.Data["value"] != nil:
		kubeconfig = secret.Data["value"]
	case secret.Data["value.yaml"] != nil:
		kubeconfig = secret.Data["value.yaml"]
	default:
		return nil, fmt.Errorf("framework: flux: KubeConfig secret '%s' does not contain a 'value' key with a kubeconfig", name)
	}
	in, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("framework: flux: KubeConfig secret '%s': %w", name, err)
	}
	out := &rest.Config{
		Host:               in.Host,
		APIPath:            in.APIPath,
		DisableCompression: in.DisableCompression,
		TLSClientConfig: rest.TLSClientConfig{
			ServerName: in.ServerName,
			CAData:     in.CAData,
			CertData:   in.CertData,
			KeyData:    in.KeyData,
		},
		WrapTransport: in.WrapTransport,
		Proxy:         in.Proxy,
		Username:      in.Username,
		Password:      in.Password,
		BearerToken:   in.BearerToken,
		Timeout:       30 * time.Second,
	}
	if opts.InsecureTLS {
		out.Insecure = in.Insecure
	}
	if opts.InsecureExecProvider {
		out.ExecProvider = in.ExecProvider
	}
	return out, nil
}
